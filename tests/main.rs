mod kernels;
mod util;
