//! Where compiled kernels are cached on disk, and writing an entry so that no reader sees
//! half of one.

use std::path::Path;

/// FNV-1a: stable across Rust versions, unlike `DefaultHasher`, so cache names stay valid.
pub(super) fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // Separate the parts so ("ab", "c") and ("a", "bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Writes a cache entry through a temporary file and a rename, so a reader never sees half
/// of one. Failures only cost a recompile next time.
pub(super) fn store(dir: &Path, path: &Path, text: &str) {
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    // Threads of one process (one per kernel file, one set per GPU) may store the same
    // entry at once: each writes its own temporary file.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
    if std::fs::write(&tmp, text).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}
