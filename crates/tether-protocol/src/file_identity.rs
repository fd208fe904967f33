//! Which file a model is, on one host: a worker reading the very file the coordinator
//! mapped (an embedded worker, or one on the same machine with `--model-path-on-workers`)
//! needs no checksum of its bytes — it would compare the file with itself — and skips the
//! pass over them that computing one costs.

use std::fs::File;

/// The machine's boot id, the file's device and inode, its length and its modification
/// time. Two processes that see the same identity read the same bytes; a file rewritten or
/// replaced changes its modification time or inode, and a file on another machine has
/// another boot id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileIdentity {
    /// `/proc/sys/kernel/random/boot_id`: unique per machine and boot.
    pub boot_id: String,
    /// The device holding the file.
    pub device: u64,
    /// Its inode.
    pub inode: u64,
    /// Its length in bytes.
    pub bytes: u64,
    /// Its modification time, in nanoseconds since the epoch.
    pub modified_ns: i64,
}

impl FileIdentity {
    /// The identity of an open file; `None` where the host has no boot id (not Linux) or
    /// the file's metadata cannot be read, so callers fall back to checksums.
    pub fn of(file: &File) -> Option<FileIdentity> {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let boot_id = boot_id.trim().to_string();
        if boot_id.is_empty() {
            return None;
        }
        Self::with_boot_id(file, boot_id)
    }

    #[cfg(unix)]
    fn with_boot_id(file: &File, boot_id: String) -> Option<FileIdentity> {
        use std::os::unix::fs::MetadataExt;
        let m = file.metadata().ok()?;
        Some(FileIdentity {
            boot_id,
            device: m.dev(),
            inode: m.ino(),
            bytes: m.size(),
            modified_ns: m.mtime().saturating_mul(1_000_000_000) + m.mtime_nsec(),
        })
    }

    #[cfg(not(unix))]
    fn with_boot_id(_file: &File, _boot_id: String) -> Option<FileIdentity> {
        None
    }

    /// Why `other` is not this file, or `None` when it is.
    pub fn differs(&self, other: &FileIdentity) -> Option<String> {
        if self.boot_id != other.boot_id {
            return Some("it is on another machine (boot id)".to_string());
        }
        if (self.device, self.inode) != (other.device, other.inode) {
            return Some(format!(
                "it is another file (device {} inode {}, not {} {})",
                other.device, other.inode, self.device, self.inode
            ));
        }
        if (self.bytes, self.modified_ns) != (other.bytes, other.modified_ns) {
            return Some(format!(
                "it was changed (length {} modified at {} ns, not {} at {} ns)",
                other.bytes, other.modified_ns, self.bytes, self.modified_ns
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_file_is_itself_until_rewritten_and_differs_from_others() {
        let dir = std::env::temp_dir().join(format!("tether-identity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a"), dir.join("b"));
        std::fs::write(&a, b"model").unwrap();
        std::fs::write(&b, b"model").unwrap();
        let Some(first) = FileIdentity::of(&File::open(&a).unwrap()) else {
            return; // no boot id on this host: identities are never used
        };
        let again = FileIdentity::of(&File::open(&a).unwrap()).unwrap();
        assert_eq!(first.differs(&again), None);
        let other = FileIdentity::of(&File::open(&b).unwrap()).unwrap();
        assert!(first.differs(&other).unwrap().contains("another file"));
        let mut f = std::fs::OpenOptions::new().append(true).open(&a).unwrap();
        f.write_all(b"!").unwrap();
        drop(f);
        let changed = FileIdentity::of(&File::open(&a).unwrap()).unwrap();
        assert!(first.differs(&changed).unwrap().contains("changed"));
        let elsewhere = FileIdentity {
            boot_id: "another".into(),
            ..first.clone()
        };
        assert!(first.differs(&elsewhere).unwrap().contains("machine"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
