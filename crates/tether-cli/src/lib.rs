//! The `tether` and `tetherctl` command lines: argument parsing and wiring only.

pub mod cmd;
pub mod model_source;
