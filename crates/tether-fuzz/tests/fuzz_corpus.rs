//! The stable fuzz loop, run by `cargo test`: every committed corpus input of every target,
//! then seeded mutations of them, with no panic and no allocation larger than the input
//! justifies (a length field turned into a huge `Vec::with_capacity` shows up here).
//!
//! `TETHER_FUZZ_ITERATIONS` (mutations per corpus file, default 400) and `TETHER_FUZZ_SEED`
//! (default: from the clock, printed) control the run; `TETHER_FUZZ_TARGETS=gguf,forward`
//! picks targets. A failing input is saved and its path, target and seed are printed.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;
use tether_fuzz::Target;
use tether_fuzz::mutate::{Rng, mutate};
use tether_fuzz::rig::Rig;
use tether_worker::server::DEFAULT_MAX_MESSAGE_BYTES;

/// Counts the largest single allocation; refuses absurd ones instead of touching them.
struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);
static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Larger requests are refused (null) so a finding fails the test instead of the machine.
const REFUSE_ABOVE: usize = 4 << 30;

/// The input being run, for the refusal report (the test cannot unwind out of `alloc`).
static CURRENT: std::sync::Mutex<Option<(&'static str, Vec<u8>)>> = std::sync::Mutex::new(None);

fn note(size: usize) -> bool {
    LARGEST.fetch_max(size, Ordering::Relaxed);
    if size > REFUSE_ABOVE {
        refused(size);
        return false;
    }
    true
}

/// Saves the input that asked for `size` bytes; the process aborts right after, when the
/// caller cannot handle a null allocation. The small allocations made here are below the
/// refusal limit, so they do not recurse into this path.
fn refused(size: usize) {
    let saved = CURRENT.try_lock().ok().and_then(|current| {
        let (target, data) = current.as_ref()?;
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-failures");
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join(format!("{target}-refused-{:016x}", fnv(data)));
        std::fs::write(&path, data).ok()?;
        Some(path)
    });
    let _ = writeln!(
        std::io::stderr(),
        "tether-fuzz: refused an allocation of {size} bytes (over 4 GiB): a finding; input saved to {saved:?}"
    );
}

// SAFETY: every call forwards to `System` with the caller's layout and pointer unchanged;
// refusing returns null, which the `GlobalAlloc` contract allows.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !note(layout.size()) {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !note(layout.size()) {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !note(new_size) {
            return std::ptr::null_mut();
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The most one input may make the process allocate at once. Stream targets also allow
/// what tonic's frame reader reserves for a frame header's announced length before the
/// bytes arrive: up to the worker's message limit (docs/limitations.md).
fn allocation_bound(target: Target, input_len: usize) -> usize {
    let bound = (64 << 20).max(16 * input_len);
    match target {
        Target::Attach | Target::Prepare => bound.max(DEFAULT_MAX_MESSAGE_BYTES + 2 * input_len),
        _ => bound,
    }
}

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus")
}

fn corpus(target: Target) -> Vec<(String, Vec<u8>)> {
    let dir = corpus_dir().join(target.name());
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

fn env_u64(name: &str) -> Option<u64> {
    let text = std::env::var(name).ok()?;
    Some(
        text.parse()
            .unwrap_or_else(|e| panic!("{name}={text:?} is not a number: {e}")),
    )
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Runs one input; on a finding saves it and fails with everything needed to replay it.
fn run_one(target: Target, data: &[u8], context: &str) {
    let panics = PANICS.load(Ordering::SeqCst);
    *CURRENT.lock().unwrap_or_else(|p| p.into_inner()) = Some((target.name(), data.to_vec()));
    LARGEST.store(0, Ordering::SeqCst);
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| target.run(data)));
    let largest = LARGEST.load(Ordering::SeqCst);
    let failure = match result {
        Err(_) => Some("it panicked (message above)".to_string()),
        Ok(Err(finding)) => Some(finding.0),
        Ok(Ok(())) if PANICS.load(Ordering::SeqCst) != panics => {
            Some("a task it started panicked (message above)".to_string())
        }
        Ok(Ok(())) if largest > allocation_bound(target, data.len()) => Some(format!(
            "one allocation of {largest} bytes for a {}-byte input (bound {})",
            data.len(),
            allocation_bound(target, data.len())
        )),
        Ok(Ok(())) => None,
    };
    if let Some(failure) = failure {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-failures");
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join(format!("{}-{:016x}", target.name(), fnv(data)));
        let _ = std::fs::write(&path, data);
        panic!(
            "fuzz target {} failed on {context}: {failure}\n  input saved to {}\n  replay: \
             copy it into fuzz/corpus/{}/ and run `cargo test -p tether-fuzz --test fuzz_corpus`",
            target.name(),
            path.display(),
            target.name()
        );
    }
}

fn selected_targets() -> Vec<Target> {
    match std::env::var("TETHER_FUZZ_TARGETS") {
        Ok(list) => Target::ALL
            .into_iter()
            .filter(|t| list.split(',').any(|n| n.trim() == t.name()))
            .collect(),
        Err(_) => Target::ALL.to_vec(),
    }
}

#[test]
fn corpus_replays_and_seeded_mutations_are_handled() {
    let iterations = env_u64("TETHER_FUZZ_ITERATIONS").unwrap_or(400);
    let seed = env_u64("TETHER_FUZZ_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let previous_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        previous_hook(info);
    }));
    // The rig is built before any input so its own allocations are not charged to one.
    let rig = Rig::get();
    let _ = writeln!(
        std::io::stderr(),
        "tether-fuzz: TETHER_FUZZ_SEED={seed} TETHER_FUZZ_ITERATIONS={iterations}"
    );
    let mut total = 0u64;
    let started = Instant::now();
    for target in selected_targets() {
        let files = corpus(target);
        assert!(
            !files.is_empty(),
            "fuzz/corpus/{} is empty; regenerate it (see tests/fuzz_corpus.rs)",
            target.name()
        );
        let target_started = Instant::now();
        for (name, bytes) in &files {
            run_one(target, bytes, &format!("corpus file {name}"));
        }
        let others: Vec<Vec<u8>> = files.iter().map(|(_, b)| b.clone()).collect();
        let mut rng = Rng::new(seed ^ fnv(target.name().as_bytes()));
        let mutations = iterations * files.len() as u64;
        for i in 0..mutations {
            let (name, bytes) = &files[i as usize % files.len()];
            let max_len = bytes.len() * 2 + 256;
            let input = mutate(bytes, &others, &mut rng, max_len);
            run_one(
                target,
                &input,
                &format!("mutation {i} of {name} (TETHER_FUZZ_SEED={seed})"),
            );
        }
        let inputs = files.len() as u64 + mutations;
        total += inputs;
        let secs = target_started.elapsed().as_secs_f64();
        let _ = writeln!(
            std::io::stderr(),
            "tether-fuzz: {:<12} {inputs:>7} inputs in {secs:>6.1} s ({:.0}/s)",
            target.name(),
            inputs as f64 / secs.max(1e-9)
        );
    }
    // The serving session survived every input: requests cannot end another's session.
    assert!(
        rig.registry
            .sessions()
            .iter()
            .any(|s| s.session_id == rig.serving().to_string()),
        "the rig's serving session ended during fuzzing"
    );
    let _ = writeln!(
        std::io::stderr(),
        "tether-fuzz: {total} inputs in {:.1} s, no findings",
        started.elapsed().as_secs_f64()
    );
}

/// Writes the seeds under fuzz/corpus/ (run after changing seeds or wire formats).
#[test]
#[ignore = "writes fuzz/corpus; run by hand"]
fn write_corpus() {
    let rig = Rig::get();
    let n = tether_fuzz::seeds::write_corpus(&corpus_dir(), &rig.model).unwrap();
    assert!(n >= Target::ALL.len());
}
