//! Reading a block's tensors ahead of the copy that stages them. A second thread touches
//! one byte of every page up to [`READ_AHEAD`] bytes ahead of the copy, after asking the
//! kernel for each tensor's pages at once: the disk (cold cache) and the page faults (warm
//! cache) are paid on that thread while the copy runs, instead of on the copy's thread.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tether_gguf::GgufFile;

/// How far ahead of the copy pages are read: enough to keep a disk's queue full for a
/// while, little beside a model's size.
const READ_AHEAD: u64 = 256 << 20;
/// One byte per page is enough to bring the page in.
const PAGE: usize = 4096;

/// How far the copy has got, shared with the thread reading ahead of it.
pub(crate) struct CopyProgress {
    copied: AtomicU64,
    done: AtomicBool,
}

impl CopyProgress {
    /// The copy has staged `bytes` more (of the tensors, in their order).
    pub(crate) fn advance(&self, bytes: u64) {
        self.copied.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// Sets `done` however the copy ends (a panic included), so the reader stops.
struct StopWhenDropped<'a>(&'a CopyProgress);

impl Drop for StopWhenDropped<'_> {
    fn drop(&mut self) {
        self.0.done.store(true, Ordering::Relaxed);
    }
}

/// Runs `copy` over `tensors` (in file order, as `copy` stages them, reporting its
/// progress) while another thread reads their pages ahead of it.
pub(crate) fn copy_with_read_ahead<R>(
    file: &GgufFile,
    tensors: &[(String, &[u8])],
    copy: impl FnOnce(&CopyProgress) -> R,
) -> R {
    let progress = CopyProgress {
        copied: AtomicU64::new(0),
        done: AtomicBool::new(false),
    };
    std::thread::scope(|scope| {
        scope.spawn(|| read_ahead(file, tensors, &progress));
        let _stop = StopWhenDropped(&progress);
        copy(&progress)
    })
}

fn read_ahead(file: &GgufFile, tensors: &[(String, &[u8])], progress: &CopyProgress) {
    let mut touched = 0u64;
    if let Some((_, first)) = tensors.first() {
        file.read_ahead(first);
    }
    for (i, (_, data)) in tensors.iter().enumerate() {
        if let Some((_, next)) = tensors.get(i + 1) {
            file.read_ahead(next);
        }
        for page in data.chunks(PAGE) {
            while touched >= progress.copied.load(Ordering::Relaxed) + READ_AHEAD {
                if progress.done.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
            if progress.done.load(Ordering::Relaxed) {
                return;
            }
            std::hint::black_box(page[0]);
            touched += page.len() as u64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_gguf::GgmlType;
    use tether_model::{SynthShape, synthesize};

    #[test]
    fn the_copy_sees_every_tensor_and_the_reader_stops_with_it() {
        let dir = crate::testing::TempDir::new();
        let path = dir.0.join("tiny.gguf");
        synthesize(&path, SynthShape::Tiny, GgmlType::F32, 3).unwrap();
        let file = GgufFile::open(&path).unwrap();
        let tensors: Vec<(String, &[u8])> = file
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), file.tensor_data(t)))
            .collect();
        let total: usize = tensors.iter().map(|(_, d)| d.len()).sum();
        let copied = copy_with_read_ahead(&file, &tensors, |progress| {
            let mut sum = 0usize;
            for (_, data) in &tensors {
                sum += data.len();
                progress.advance(data.len() as u64);
            }
            sum
        });
        assert_eq!(copied, total);
        // A copy that stops at once (an error) ends the reader too: this returns.
        let stopped = copy_with_read_ahead(&file, &tensors, |_| "stopped");
        assert_eq!(stopped, "stopped");
    }
}
