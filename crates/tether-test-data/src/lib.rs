//! Where tests find optional data too large for the repository: real GGUF models
//! (`models/`) and llama.cpp's tokenizer test vectors (`tokenizers/`). Tests that need it
//! skip, saying why, when it is absent, so a clean clone passes without it.

use std::path::PathBuf;

/// The variable naming the test data folder.
pub const VAR: &str = "TETHER_TEST_DATA";

/// The test data folder: `$TETHER_TEST_DATA`, else the folder `shared` beside the
/// workspace root, where a development checkout keeps it.
pub fn dir() -> PathBuf {
    match std::env::var_os(VAR) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"),
    }
}

/// `relative` (such as `models/stories260K.gguf`) inside the test data folder when it
/// exists; otherwise prints why the calling test skips its part and returns `None`.
pub fn path(relative: &str) -> Option<PathBuf> {
    let path = dir().join(relative);
    if path.exists() {
        return Some(path);
    }
    eprintln!(
        "skipped: {} is absent (set {VAR} to a folder holding models/ and tokenizers/)",
        path.display()
    );
    None
}

/// `models/stories260K.gguf`, the small real llama most tests use, when present.
pub fn stories260k() -> Option<PathBuf> {
    path("models/stories260K.gguf")
}
