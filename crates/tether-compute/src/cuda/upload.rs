//! Weight uploads of one load, overlapped: each piece is copied into one of a few pinned
//! host buffers and sent to the device from there on one of several streams, so the CPU
//! fills the next buffer (reading the model's pages) while earlier pieces are on their way.
//! A copy from pageable memory, as `upload` does, makes the driver stage it itself and the
//! CPU wait for each piece.
//!
//! The pinned buffers and streams belong to the stage being loaded (through
//! [`CudaUploads`]) and go when its load finishes; they hold no device memory.

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaEvent, CudaStream, result};

use crate::backend::Result;
use crate::cuda::device::{Device, driver_err};
use crate::cuda::staging::PinnedHost;

/// Bytes of one pinned buffer: large enough that a copy's fixed cost is small, small
/// enough that the first copy starts soon.
const PIECE_BYTES: usize = 8 << 20;
/// Pinned buffers: how far the CPU may run ahead of the copies.
const BUFFERS: usize = 4;
/// Copy streams: two keep the copy engine busy while one piece's copy is being issued.
const STREAMS: usize = 2;
/// Bytes each thread copies into a pinned buffer: one thread reading a file's mapped pages
/// (a page fault per 4 KiB when the read-ahead has not mapped them yet) moves ~6 GB/s, well
/// under what the copy engine takes, so a piece is filled by several threads at once.
const FILL_SPLIT: usize = 1 << 20;

/// One pinned buffer and the event recorded after the last copy out of it.
struct Buffer {
    host: PinnedHost,
    copied: CudaEvent,
    in_flight: bool,
}

/// The state of one load's uploads: pinned buffers and copy streams. Dropping it waits for
/// every copy (they read the pinned buffers and write the stage's weights).
pub struct CudaUploads {
    device: Arc<Device>,
    streams: Vec<Arc<CudaStream>>,
    buffers: Vec<Buffer>,
    next: usize,
}

impl CudaUploads {
    /// Pinned buffers and copy streams on `device`. The streams start after everything
    /// already issued on the device's stream (the zeroing of fresh weights).
    pub(crate) fn new(device: &Arc<Device>) -> Result<Self> {
        device.flush_recorded()?;
        device.bind()?;
        let mut streams = Vec::with_capacity(STREAMS);
        for _ in 0..STREAMS {
            let stream = device
                .stream
                .fork()
                .map_err(|e| driver_err("creating a copy stream for the upload", e))?;
            streams.push(stream);
        }
        let mut buffers = Vec::with_capacity(BUFFERS);
        for _ in 0..BUFFERS {
            let copied = device
                .ctx
                .new_event(None)
                .map_err(|e| driver_err("creating an upload event", e))?;
            buffers.push(Buffer {
                host: PinnedHost::new(device, PIECE_BYTES)?,
                copied,
                in_flight: false,
            });
        }
        Ok(Self {
            device: Arc::clone(device),
            streams,
            buffers,
            next: 0,
        })
    }

    /// Queues the copy of `src` to device address `dst`. `src` is read before this returns;
    /// the copies are done once [`CudaUploads::wait`] returns.
    pub(crate) fn copy(&mut self, dst: CUdeviceptr, src: &[u8]) -> Result<()> {
        self.device.bind()?;
        let mut at = dst;
        for piece in src.chunks(PIECE_BYTES) {
            let slot = self.next % BUFFERS;
            let stream = Arc::clone(&self.streams[self.next % STREAMS]);
            self.next += 1;
            let buffer = &mut self.buffers[slot];
            if buffer.in_flight {
                buffer
                    .copied
                    .synchronize()
                    .map_err(|e| driver_err("waiting for an earlier upload", e))?;
                buffer.in_flight = false;
            }
            fill(buffer.host.bytes_mut(piece.len()), piece);
            // SAFETY: the caller checked that `dst..dst + src.len()` lies in one buffer; the
            // pinned source stays untouched until `copied` has completed (waited above
            // before reuse, and in `wait`/drop before it is freed).
            unsafe {
                result::memcpy_htod_async(at, buffer.host.bytes(piece.len()), stream.cu_stream())
            }
            .map_err(|e| driver_err(&format!("uploading {} bytes", piece.len()), e))?;
            buffer
                .copied
                .record(&stream)
                .map_err(|e| driver_err("recording an upload event", e))?;
            buffer.in_flight = true;
            at += piece.len() as u64;
        }
        Ok(())
    }

    /// Waits until every queued copy is done.
    pub(crate) fn wait(&mut self) -> Result<()> {
        self.device.bind()?;
        for stream in &self.streams {
            stream
                .synchronize()
                .map_err(|e| driver_err("waiting for the uploads", e))?;
        }
        for buffer in &mut self.buffers {
            buffer.in_flight = false;
        }
        Ok(())
    }
}

/// `dst.copy_from_slice(src)`, by several threads when `src` is large.
fn fill(dst: &mut [u8], src: &[u8]) {
    use rayon::prelude::*;
    if src.len() <= FILL_SPLIT {
        dst.copy_from_slice(src);
        return;
    }
    dst.par_chunks_mut(FILL_SPLIT)
        .zip(src.par_chunks(FILL_SPLIT))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

impl Drop for CudaUploads {
    fn drop(&mut self) {
        // The copies read the pinned buffers freed next and write weights that may be freed
        // right after; a failed wait means the context is broken, and nothing better is left.
        if self.buffers.iter().any(|b| b.in_flight) {
            let _ = self.wait();
        }
    }
}
