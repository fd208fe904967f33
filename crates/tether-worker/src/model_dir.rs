//! The directories a worker reads model files from (`--model-dir`). A coordinator names a
//! file with `--model-path-on-workers`; the worker opens it only when, every symlink and
//! `..` resolved, it lies inside one of these directories, so a coordinator cannot make a
//! worker read anything else.

use std::fs::File;
use std::path::{Component, Path, PathBuf};
use tether_protocol::{Result, WorkerError};

/// One allowed directory, as given (made absolute) and with its symlinks resolved.
#[derive(Clone, Debug)]
struct Root {
    given: PathBuf,
    real: PathBuf,
}

/// The directory trees a worker may read model files from; empty when it reads none.
#[derive(Clone, Debug, Default)]
pub struct ModelDirs {
    roots: Vec<Root>,
}

/// A model file opened inside a [`ModelDirs`].
#[derive(Debug)]
pub struct AllowedFile {
    /// Its path with every symlink resolved.
    pub path: PathBuf,
    /// The open file.
    pub file: File,
}

impl ModelDirs {
    /// The directories `dirs`, each of which must exist and be a directory.
    pub fn new(dirs: &[PathBuf]) -> std::result::Result<Self, String> {
        let cwd =
            std::env::current_dir().map_err(|e| format!("reading the current directory: {e}"))?;
        let mut roots = Vec::with_capacity(dirs.len());
        for dir in dirs {
            let real = dir
                .canonicalize()
                .map_err(|e| format!("--model-dir {}: {e}", dir.display()))?;
            if !real.is_dir() {
                return Err(format!("--model-dir {} is not a directory", dir.display()));
            }
            roots.push(Root {
                given: normalize(&cwd.join(dir)),
                real,
            });
        }
        Ok(Self { roots })
    }

    /// Whether no directory is allowed (the worker reads no model file of its own).
    pub fn is_empty(&self) -> bool {
        self.roots.is_empty()
    }

    /// The allowed directories, symlinks resolved.
    pub fn dirs(&self) -> impl Iterator<Item = &Path> {
        self.roots.iter().map(|r| r.real.as_path())
    }

    /// Opens `requested`: an absolute path, or one relative to an allowed directory (tried
    /// in order). Refused when no directory is allowed, when the path — lexically, then
    /// with symlinks resolved — leaves every allowed directory, or when it is not a regular
    /// file. Paths outside are refused before the file system is asked, so the answer does
    /// not tell whether a file exists there.
    pub fn open(&self, requested: &str) -> Result<AllowedFile> {
        if self.roots.is_empty() {
            return Err(WorkerError::LocalFile(
                "this worker reads no model file of its own: it was started without --model-dir; start it with --model-dir DIR holding the model".into(),
            ));
        }
        if requested.is_empty() || requested.contains('\0') {
            return Err(WorkerError::LocalFile(format!(
                "{requested:?} is not a usable model path"
            )));
        }
        let requested_path = Path::new(requested);
        let candidates: Vec<PathBuf> = if requested_path.is_absolute() {
            vec![normalize(requested_path)]
        } else {
            self.roots
                .iter()
                .map(|r| normalize(&r.real.join(requested_path)))
                .collect()
        };
        let mut missing = None;
        for candidate in candidates {
            if !self.lexically_inside(&candidate) {
                return Err(self.outside(requested));
            }
            let real = match candidate.canonicalize() {
                Ok(real) => real,
                Err(e) => {
                    missing.get_or_insert(e);
                    continue;
                }
            };
            if !self.really_inside(&real) {
                return Err(self.outside(requested));
            }
            return self.open_real(requested, real);
        }
        let why = missing.map_or_else(String::new, |e| format!(": {e}"));
        Err(WorkerError::LocalFile(format!(
            "model file {requested:?} is not on this worker{why} (looked in --model-dir {})",
            self.list()
        )))
    }

    fn open_real(&self, requested: &str, real: PathBuf) -> Result<AllowedFile> {
        let refuse = |what: String| {
            WorkerError::LocalFile(format!(
                "model file {requested:?} ({}): {what}",
                real.display()
            ))
        };
        let meta = std::fs::metadata(&real).map_err(|e| refuse(e.to_string()))?;
        if !meta.is_file() {
            return Err(refuse("not a regular file".into()));
        }
        let file = open_no_follow(&real).map_err(|e| refuse(format!("opening it: {e}")))?;
        // The path was checked before opening; another process may have swapped a
        // directory for a symlink since. What was opened is what counts.
        if let Some(opened) = opened_path(&file)
            && !self.really_inside(&opened)
        {
            return Err(self.outside(requested));
        }
        Ok(AllowedFile { path: real, file })
    }

    fn lexically_inside(&self, path: &Path) -> bool {
        self.roots
            .iter()
            .any(|r| path.starts_with(&r.given) || path.starts_with(&r.real))
    }

    fn really_inside(&self, real: &Path) -> bool {
        self.roots.iter().any(|r| real.starts_with(&r.real))
    }

    fn outside(&self, requested: &str) -> WorkerError {
        WorkerError::LocalFile(format!(
            "model file {requested:?} lies outside this worker's --model-dir ({}), symlinks and .. resolved; the worker reads no file there",
            self.list()
        ))
    }

    fn list(&self) -> String {
        let dirs: Vec<String> = self.dirs().map(|d| d.display().to_string()).collect();
        dirs.join(", ")
    }
}

/// `path` with `.` dropped and `..` applied, without asking the file system (a `..` above
/// the root stays at the root, as the kernel does).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

#[cfg(unix)]
fn open_no_follow(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

#[cfg(not(unix))]
fn open_no_follow(path: &Path) -> std::io::Result<File> {
    File::open(path)
}

/// The path the kernel has for an open file (Linux); `None` where it cannot be read.
#[cfg(target_os = "linux")]
fn opened_path(file: &File) -> Option<PathBuf> {
    use std::os::fd::AsRawFd;
    std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).ok()
}

#[cfg(not(target_os = "linux"))]
fn opened_path(_file: &File) -> Option<PathBuf> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::TempDir;

    /// A tree: `models/m.gguf`, `models/sub/n.gguf`, `secret/s.gguf` beside it.
    fn tree() -> (TempDir, ModelDirs) {
        let dir = TempDir::new();
        std::fs::create_dir_all(dir.0.join("models/sub")).unwrap();
        std::fs::create_dir_all(dir.0.join("secret")).unwrap();
        std::fs::write(dir.0.join("models/m.gguf"), b"model").unwrap();
        std::fs::write(dir.0.join("models/sub/n.gguf"), b"nested").unwrap();
        std::fs::write(dir.0.join("secret/s.gguf"), b"secret").unwrap();
        let dirs = ModelDirs::new(&[dir.0.join("models")]).unwrap();
        (dir, dirs)
    }

    fn refusal(dirs: &ModelDirs, path: &str) -> String {
        match dirs.open(path) {
            Ok(f) => panic!("{path} was opened as {}", f.path.display()),
            Err(WorkerError::LocalFile(m)) => m,
            Err(other) => panic!("{path}: not a local-file refusal: {other:?}"),
        }
    }

    fn read(mut f: AllowedFile) -> String {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut f.file, &mut s).unwrap();
        s
    }

    #[test]
    fn files_inside_open_by_absolute_and_relative_path() {
        let (dir, dirs) = tree();
        let abs = dir.0.join("models/m.gguf");
        assert_eq!(read(dirs.open(abs.to_str().unwrap()).unwrap()), "model");
        assert_eq!(read(dirs.open("m.gguf").unwrap()), "model");
        assert_eq!(read(dirs.open("sub/n.gguf").unwrap()), "nested");
        assert_eq!(read(dirs.open("sub/../m.gguf").unwrap()), "model");
    }

    #[test]
    fn dot_dot_and_absolute_paths_outside_are_refused() {
        let (dir, dirs) = tree();
        for path in [
            "../secret/s.gguf".to_string(),
            "sub/../../secret/s.gguf".to_string(),
            dir.0.join("secret/s.gguf").display().to_string(),
            dir.0.join("models/../secret/s.gguf").display().to_string(),
            "/etc/passwd".to_string(),
        ] {
            let m = refusal(&dirs, &path);
            assert!(m.contains("outside"), "{path}: {m}");
        }
    }

    #[test]
    fn outside_paths_are_refused_the_same_whether_or_not_they_exist() {
        let (dir, dirs) = tree();
        let there = refusal(&dirs, &dir.0.join("secret/s.gguf").display().to_string());
        let absent = refusal(&dirs, &dir.0.join("secret/none.gguf").display().to_string());
        assert_eq!(
            there.replace("s.gguf", "X"),
            absent.replace("none.gguf", "X")
        );
    }

    #[cfg(unix)]
    #[test]
    fn symlinks_escaping_the_directory_are_refused_and_inner_ones_followed() {
        let (dir, dirs) = tree();
        std::os::unix::fs::symlink(dir.0.join("secret/s.gguf"), dir.0.join("models/link.gguf"))
            .unwrap();
        std::os::unix::fs::symlink(dir.0.join("secret"), dir.0.join("models/escape")).unwrap();
        std::os::unix::fs::symlink(dir.0.join("models/m.gguf"), dir.0.join("models/alias.gguf"))
            .unwrap();
        assert!(refusal(&dirs, "link.gguf").contains("outside"));
        assert!(refusal(&dirs, "escape/s.gguf").contains("outside"));
        let via_link = dir.0.join("models/escape/s.gguf");
        assert!(refusal(&dirs, via_link.to_str().unwrap()).contains("outside"));
        assert_eq!(read(dirs.open("alias.gguf").unwrap()), "model");
    }

    #[cfg(unix)]
    #[test]
    fn a_model_dir_reached_through_a_symlink_accepts_both_spellings() {
        let (dir, _) = tree();
        std::os::unix::fs::symlink(dir.0.join("models"), dir.0.join("models-link")).unwrap();
        let dirs = ModelDirs::new(&[dir.0.join("models-link")]).unwrap();
        let via_link = dir.0.join("models-link/m.gguf");
        let real = dir.0.join("models/m.gguf");
        assert_eq!(
            read(dirs.open(via_link.to_str().unwrap()).unwrap()),
            "model"
        );
        assert_eq!(read(dirs.open(real.to_str().unwrap()).unwrap()), "model");
    }

    #[test]
    fn missing_files_directories_and_no_model_dir_are_refused() {
        let (_dir, dirs) = tree();
        assert!(refusal(&dirs, "none.gguf").contains("not on this worker"));
        assert!(refusal(&dirs, "sub").contains("not a regular file"));
        assert!(refusal(&dirs, "").contains("not a usable"));
        assert!(refusal(&dirs, "m.gguf\0x").contains("not a usable"));
        let none = ModelDirs::default();
        assert!(none.is_empty());
        assert!(refusal(&none, "m.gguf").contains("without --model-dir"));
    }

    #[test]
    fn model_dirs_must_exist_and_be_directories() {
        let (dir, _) = tree();
        assert!(ModelDirs::new(&[dir.0.join("nope")]).is_err());
        assert!(ModelDirs::new(&[dir.0.join("models/m.gguf")]).is_err());
    }

    #[test]
    fn a_sibling_with_a_common_prefix_is_not_inside() {
        let (dir, dirs) = tree();
        std::fs::create_dir_all(dir.0.join("models2")).unwrap();
        std::fs::write(dir.0.join("models2/x.gguf"), b"x").unwrap();
        let path = dir.0.join("models2/x.gguf");
        assert!(refusal(&dirs, path.to_str().unwrap()).contains("outside"));
    }

    #[test]
    fn normalize_applies_dot_and_dot_dot_without_the_file_system() {
        assert_eq!(normalize(Path::new("/a/./b/../c")), PathBuf::from("/a/c"));
        assert_eq!(normalize(Path::new("/../../x")), PathBuf::from("/x"));
    }
}
