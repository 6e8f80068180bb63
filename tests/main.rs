mod tokenizer;
mod util;
