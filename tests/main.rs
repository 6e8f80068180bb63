mod kernels;
mod run;
mod util;
