//! The `tether` and `tetherctl` command lines: argument parsing and wiring only.

pub mod cmd;
pub mod ctl;
pub mod device;
pub mod load_bars;
pub mod model_source;
pub mod signals;
pub mod timings;

/// Prints an error with its causes on one line (no backtrace: users read these) and maps
/// the outcome to the process exit status.
pub fn exit_code(result: anyhow::Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
