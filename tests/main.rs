mod convert;
mod util;
