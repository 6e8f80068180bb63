mod convert;
mod kernels;
mod run;
mod util;
mod tokenizer;
