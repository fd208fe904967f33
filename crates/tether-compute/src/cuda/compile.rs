//! Kernel sources (CUDA C in the repo's `kernels/`), compiled by NVRTC for the device's
//! compute capability and cached on disk as PTX.
//!
//! The cache key is a hash of the source, the architecture and the NVRTC version, so a
//! changed kernel, another GPU or another NVRTC never picks up a stale entry. A missing,
//! unreadable or corrupt entry is recompiled; failing to write the cache is not an error.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};

use super::kernel_files::source::COMMON;
use super::kernel_files::{FILES, KernelFile};
use super::ptx_cache::{fnv1a, store};
use crate::backend::Result;
use crate::cuda::device::driver_err;
use crate::error::ComputeError;

/// A loaded kernel entry point and whether it may be launched as a programmatic
/// dependent launch.
#[derive(Clone)]
pub(crate) struct Kernel {
    pub(crate) function: CudaFunction,
    pub(crate) dependent_launch: bool,
}

/// Every kernel entry point, loaded into the backend's context.
pub(crate) struct Kernels {
    functions: HashMap<&'static str, Kernel>,
}

impl Kernels {
    /// Compiles (or reads from the disk cache) and loads every kernel file for compute
    /// capability `cc` (`(9, 0)` for an H100), caching compiled files in `dir`.
    /// Sources found in `sources` (`NAME.cu`, `common.cuh`) replace the built-in ones.
    pub(crate) fn load(
        ctx: &Arc<CudaContext>,
        cc: (i32, i32),
        dir: Option<&Path>,
        sources: Option<&Path>,
    ) -> Result<Self> {
        let nvrtc = nvrtc_version()?;
        let common = replaced(sources, "common.cuh", COMMON)?;
        let texts = FILES
            .iter()
            .map(|f| replaced(sources, &format!("{}.cu", f.name), f.source))
            .collect::<Result<Vec<String>>>()?;
        // Each file compiles on its own thread: NVRTC takes seconds to minutes a file, and a
        // machine's first start (an empty cache) would otherwise pay them one after another.
        let compiled: Vec<Result<(String, bool)>> = std::thread::scope(|scope| {
            let jobs: Vec<_> = FILES
                .iter()
                .zip(&texts)
                .map(|(file, text)| {
                    let source = Source {
                        common: &common,
                        file: text,
                    };
                    scope.spawn(move || module_ptx(file, source, cc, nvrtc, dir, true))
                })
                .collect();
            jobs.into_iter()
                .map(|job| {
                    job.join().unwrap_or_else(|_| {
                        Err(ComputeError::Device(
                            "a kernel compile thread panicked".to_string(),
                        ))
                    })
                })
                .collect()
        });
        let mut functions = HashMap::new();
        for ((file, text), compiled) in FILES.iter().zip(&texts).zip(compiled) {
            let load_err = |e| {
                driver_err(
                    &format!(
                        "loading kernel module {} (PTX from NVRTC {}.{}) for sm_{}{}; \
                         the driver may be older than NVRTC",
                        file.name, nvrtc.0, nvrtc.1, cc.0, cc.1
                    ),
                    e,
                )
            };
            let (ptx, cached) = compiled?;
            let module = match ctx.load_module(Ptx::from_src(ptx)) {
                Ok(m) => m,
                // A cache entry the driver rejects is treated like a corrupt one.
                Err(_) if cached => {
                    let source = Source {
                        common: &common,
                        file: text,
                    };
                    let (ptx, _) = module_ptx(file, source, cc, nvrtc, dir, false)?;
                    ctx.load_module(Ptx::from_src(ptx)).map_err(load_err)?
                }
                Err(e) => return Err(load_err(e)),
            };
            for &entry in file.entries {
                let f = module.load_function(entry).map_err(|e| {
                    driver_err(&format!("finding kernel {entry} in {}", file.name), e)
                })?;
                let kernel = Kernel {
                    function: f,
                    dependent_launch: file.dependent_launch,
                };
                functions.insert(entry, kernel);
            }
        }
        Ok(Self { functions })
    }

    /// The entry point `name` (one of the names listed in [`super::kernel_files::FILES`]).
    pub(crate) fn get(&self, name: &str) -> Result<&Kernel> {
        self.functions.get(name).ok_or_else(|| {
            ComputeError::Device(format!("kernel {name} was not loaded; this is a bug"))
        })
    }
}

/// NVRTC's (major, minor) version; fails clearly when libnvrtc cannot be loaded.
fn nvrtc_version() -> Result<(i32, i32)> {
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(ComputeError::Unavailable(
            "NVRTC (libnvrtc.so) was not found, and the CUDA backend compiles its kernels \
             with it: install the CUDA toolkit's NVRTC or add its lib directory to \
             LD_LIBRARY_PATH"
                .to_string(),
        ));
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; both pointers are valid for the call.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(ComputeError::Unavailable(format!(
            "asking NVRTC for its version failed ({status:?})"
        )));
    }
    Ok((major, minor))
}

/// The text of kernel source `name`: the file of that name in `dir` when there is one,
/// else `built_in`.
fn replaced(dir: Option<&Path>, name: &str, built_in: &str) -> Result<String> {
    let Some(path) = dir.map(|d| d.join(name)).filter(|p| p.exists()) else {
        return Ok(built_in.to_string());
    };
    std::fs::read_to_string(&path).map_err(|e| {
        ComputeError::Device(format!(
            "reading kernel source {} (TETHER_KERNEL_SOURCES): {e}",
            path.display()
        ))
    })
}

/// The texts one kernel file compiles from: the common header and the file itself.
#[derive(Clone, Copy)]
struct Source<'a> {
    common: &'a str,
    file: &'a str,
}

/// The name of the cache entry of `file` compiled from `source` for this architecture and
/// NVRTC.
fn cache_name(file: &KernelFile, source: Source, cc: (i32, i32), nvrtc: (i32, i32)) -> String {
    let arch = format!("sm_{}{}", cc.0, cc.1);
    let version = format!("nvrtc{}.{}", nvrtc.0, nvrtc.1);
    let hash = fnv1a(&[
        source.common.as_bytes(),
        source.file.as_bytes(),
        arch.as_bytes(),
        version.as_bytes(),
    ]);
    format!("{}-{hash:016x}-{arch}-{version}.ptx", file.name)
}

/// A PTX text that looks whole: NVRTC's output always declares `.version` and the entries.
fn plausible_ptx(text: &str, file: &KernelFile) -> bool {
    !text.contains('\0')
        && text.contains(".version")
        && file.entries.iter().all(|e| text.contains(e))
}

/// The PTX of `file` and whether it came from the cache: from the cache when `use_cache`
/// and a valid entry exists, else compiled (and written to the cache).
fn module_ptx(
    file: &KernelFile,
    source: Source,
    cc: (i32, i32),
    nvrtc: (i32, i32),
    dir: Option<&Path>,
    use_cache: bool,
) -> Result<(String, bool)> {
    let path = dir.map(|d| d.join(cache_name(file, source, cc, nvrtc)));
    if use_cache
        && let Some(text) = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok())
        && plausible_ptx(&text, file)
    {
        return Ok((text, true));
    }
    let source = format!("{}\n{}", source.common, source.file);
    let opts = CompileOptions {
        options: vec![
            format!("--gpu-architecture=compute_{}{}", cc.0, cc.1),
            "--std=c++17".to_string(),
        ],
        name: Some(format!("{}.cu", file.name)),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(&source, opts).map_err(|e| ComputeError::Compile {
        what: format!(
            "NVRTC {}.{} failed to compile kernels/{}.cu for sm_{}{}",
            nvrtc.0, nvrtc.1, file.name, cc.0, cc.1
        ),
        source: e,
    })?;
    let text = ptx.to_src();
    if let (Some(path), Some(dir)) = (path, dir) {
        store(dir, &path, &text);
    }
    Ok((text, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_names_change_with_arch_nvrtc_and_source() {
        let f = &FILES[0];
        let built_in = Source {
            common: COMMON,
            file: f.source,
        };
        let a = cache_name(f, built_in, (9, 0), (12, 8));
        assert_ne!(a, cache_name(f, built_in, (8, 0), (12, 8)));
        assert_ne!(a, cache_name(f, built_in, (9, 0), (13, 0)));
        let edited = format!("{}\n// a variant", f.source);
        let variant = Source {
            common: COMMON,
            file: &edited,
        };
        assert_ne!(a, cache_name(f, variant, (9, 0), (12, 8)));
        assert!(a.starts_with("matvec-") && a.ends_with("-sm_90-nvrtc12.8.ptx"));
    }

    #[test]
    fn a_source_folder_replaces_only_the_files_it_holds() {
        let dir = std::env::temp_dir().join(format!("tether-ksrc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("matvec.cu"), "// variant").unwrap();
        let got = |name| replaced(Some(&dir), name, "built in").unwrap();
        assert_eq!(got("matvec.cu"), "// variant");
        assert_eq!(got("gemm.cu"), "built in");
        assert_eq!(replaced(None, "matvec.cu", "built in").unwrap(), "built in");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Every kernel file compiles with the NVRTC this machine has, for an H100, and its PTX
    /// names every entry: a kernel edit that does not compile is caught without a GPU.
    /// Where no libnvrtc loads the test says "skipped" and passes (CI installs NVRTC's pip
    /// wheel for it).
    #[test]
    fn every_kernel_file_compiles_where_nvrtc_is_installed() {
        let nvrtc = match nvrtc_version() {
            Ok(v) => v,
            Err(e) => {
                eprintln!("skipped: {e}");
                return;
            }
        };
        let compiled: Vec<(&KernelFile, Result<(String, bool)>)> = std::thread::scope(|scope| {
            let jobs: Vec<_> = FILES
                .iter()
                .map(|f| {
                    let source = Source {
                        common: COMMON,
                        file: f.source,
                    };
                    (
                        f,
                        scope.spawn(move || module_ptx(f, source, (9, 0), nvrtc, None, false)),
                    )
                })
                .collect();
            jobs.into_iter()
                .map(|(f, j)| (f, j.join().expect("a compile thread panicked")))
                .collect()
        });
        for (f, result) in compiled {
            match result {
                Ok((ptx, cached)) => {
                    assert!(!cached, "{}: no cache was given", f.name);
                    assert!(plausible_ptx(&ptx, f), "{}: an entry is missing", f.name);
                }
                Err(e) => panic!("kernels/{}.cu: {e:?}", f.name),
            }
        }
    }

    #[test]
    fn hash_separates_parts() {
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }

    #[test]
    fn truncated_or_foreign_ptx_is_rejected() {
        let f = &FILES[1];
        let good = format!(".version 8.0\n{}", f.entries.join("\n"));
        assert!(plausible_ptx(&good, f));
        assert!(!plausible_ptx(&good[..good.len() - 3], f));
        assert!(!plausible_ptx(&format!("{good}\0"), f));
        assert!(!plausible_ptx("garbage", f));
    }
}
