mod util;
mod tokenizer;
