//! Decode steps replayed as CUDA graphs.
//!
//! A decode step is hundreds of small launches; enqueueing them one by one costs the host
//! more time than the GPU spends running them. Inside [`Backend::replay`] the backend
//! records each launch, index copy and memset as a [`Cmd`] instead of issuing it. At the end
//! of the step the list is compared with the one recorded under the same key last time:
//! equal (same kernels, arguments, addresses) means the captured graph does exactly what
//! issuing the list would, so one graph launch replaces them. The index arrays a step
//! copies change every step, but they sit at the same pinned-host addresses (the staging
//! ring restarts at the step's start), so the graph's copies read the new values.
//!
//! A list seen for the first time runs eagerly; seen twice in a row it is captured. Any
//! operation that needs the stream in order (download, synchronize, a buffer's drop)
//! first issues what was recorded and ends recording for that step.
//!
//! A step is issued in pieces as it is recorded (the first few commands, then four times as
//! many, and so on), each compared and captured on its own: the GPU runs the first layers
//! while the host records the rest, instead of idling through the whole recording (about
//! 0.2 ms of a 2.7 ms step on an 8B model).
//!
//! Graphs belong to the caller's [`CudaReplays`] (a stage, so a session) and are destroyed
//! with it.
//!
//! [`Backend::replay`]: crate::Backend::replay

use std::cell::RefCell;
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaFunction, CudaGraph, CudaStream, LaunchConfig, result};

use super::device::{Device, driver_err};
use super::launch::{Arg, launch};
use crate::backend::Result;

/// Most pieces of steps (of every key) a stage keeps graphs for: 8 batch sizes of a few
/// pieces each.
const MAX_ENTRIES: usize = 48;
/// Commands in a step's first piece: enough for about one layer, so the GPU starts soon.
const FIRST_PIECE: usize = 12;
/// Each piece holds this many times the commands of the one before: the GPU runs a piece
/// while the host records the next, which costs far less per command than running it.
const PIECE_GROWTH: usize = 4;

/// Commands in piece `piece` of a step (pieces count from 0).
fn piece_len(piece: u32) -> usize {
    FIRST_PIECE.saturating_mul(PIECE_GROWTH.saturating_pow(piece))
}

/// One stream operation, as issued or as recorded.
#[derive(Clone)]
pub(crate) enum Cmd {
    Launch {
        name: String,
        func: CudaFunction,
        /// Launch as a programmatic dependent launch (see `PDL_ENTRY` in common.cuh).
        dependent: bool,
        cfg: LaunchConfig,
        args: Vec<Arg>,
    },
    /// Copy `bytes` from pinned host memory at `src` to device address `dst`.
    HostToDevice { dst: u64, src: usize, bytes: usize },
    /// Zero `bytes` at device address `dst`.
    Zero { dst: u64, bytes: usize },
}

impl PartialEq for Cmd {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (
                Cmd::Launch {
                    name: a,
                    dependent: p,
                    cfg: c,
                    args: x,
                    ..
                },
                Cmd::Launch {
                    name: b,
                    dependent: q,
                    cfg: d,
                    args: y,
                    ..
                },
            ) => {
                a == b
                    && p == q
                    && (c.grid_dim, c.block_dim, c.shared_mem_bytes)
                        == (d.grid_dim, d.block_dim, d.shared_mem_bytes)
                    && x == y
            }
            (
                Cmd::HostToDevice { dst, src, bytes },
                Cmd::HostToDevice {
                    dst: d,
                    src: s,
                    bytes: b,
                },
            ) => (dst, src, bytes) == (d, s, b),
            (Cmd::Zero { dst, bytes }, Cmd::Zero { dst: d, bytes: b }) => (dst, bytes) == (d, b),
            _ => false,
        }
    }
}

impl Cmd {
    /// Issues the operation on `stream`.
    fn issue(&self, stream: &CudaStream) -> Result<()> {
        match self {
            Cmd::Launch {
                name,
                func,
                dependent,
                cfg,
                args,
            } => launch(stream, func, name, *cfg, args, *dependent),
            Cmd::HostToDevice { dst, src, bytes } => {
                // SAFETY: `src` is `bytes` of the staging ring's pinned host memory, which
                // lives as long as the backend and is not rewritten before the stream has
                // passed this copy (see staging.rs); `dst` is inside the device ring.
                let host = unsafe { std::slice::from_raw_parts(*src as *const u8, *bytes) };
                unsafe { result::memcpy_htod_async(*dst, host, stream.cu_stream()) }
                    .map_err(|e| driver_err(&format!("staging {bytes} bytes of indices"), e))
            }
            Cmd::Zero { dst, bytes } => {
                // SAFETY: the op that recorded this checked that `dst` holds `bytes` bytes of
                // a live buffer; buffers outlive recorded commands (a drop flushes first).
                unsafe { result::memset_d8_async(*dst, 0, *bytes, stream.cu_stream()) }
                    .map_err(|e| driver_err("zeroing an output", e))
            }
        }
    }
}

/// What the current thread is recording, if anything.
struct Recording {
    /// The device recorded for (ops of another backend on this thread issue directly).
    device: *const Device,
    /// The commands of the current piece.
    cmds: Vec<Cmd>,
    /// Set when something forced the commands out early: the step then runs eagerly.
    flushed: bool,
    /// The step's key, and the number of the current piece.
    key: u64,
    piece: u32,
    /// The stage's graphs, moved here for the step (and back at its end).
    replays: CudaReplays,
    /// The side stream graphs are captured on.
    capture: Arc<CudaStream>,
}

thread_local! {
    static RECORDING: RefCell<Option<Recording>> = const { RefCell::new(None) };
}

impl Device {
    /// Issues `cmd` on the stream, or records it when this thread records for this device.
    pub(crate) fn submit(&self, cmd: Cmd) -> Result<()> {
        let me = self as *const Device;
        let cmd = RECORDING.with(|r| match r.borrow_mut().as_mut() {
            Some(rec) if rec.device == me && !rec.flushed => {
                rec.cmds.push(cmd);
                if rec.cmds.len() < piece_len(rec.piece) {
                    return Ok(None);
                }
                // A whole piece: issue it now, so the GPU starts on it. Issuing and
                // capturing touch only the driver, never this thread's recording.
                let cmds = std::mem::take(&mut rec.cmds);
                let piece = rec.piece;
                rec.piece += 1;
                issue_piece(self, &rec.capture, &mut rec.replays, rec.key, piece, cmds)?;
                Ok(None)
            }
            _ => Ok(Some(cmd)),
        })?;
        match cmd {
            Some(cmd) => {
                self.bind()?;
                cmd.issue(&self.stream)
            }
            None => Ok(()),
        }
    }

    /// Whether this thread is recording (and not yet flushed) for this device.
    pub(crate) fn recording_here(&self) -> bool {
        let me = self as *const Device;
        RECORDING.with(|r| {
            r.borrow()
                .as_ref()
                .is_some_and(|rec| rec.device == me && !rec.flushed)
        })
    }

    /// Issues whatever this thread has recorded for this device, so that a direct stream
    /// operation comes after it; the rest of the step then runs eagerly.
    pub(crate) fn flush_recorded(&self) -> Result<()> {
        let me = self as *const Device;
        let cmds = RECORDING.with(|r| match r.borrow_mut().as_mut() {
            Some(rec) if rec.device == me && !rec.flushed => {
                rec.flushed = true;
                std::mem::take(&mut rec.cmds)
            }
            _ => Vec::new(),
        });
        if cmds.is_empty() {
            return Ok(());
        }
        self.bind()?;
        cmds.iter().try_for_each(|c| c.issue(&self.stream))
    }
}

/// Captured decode steps of one stage, by key.
#[derive(Default)]
pub struct CudaReplays {
    entries: Vec<Entry>,
}

struct Entry {
    key: u64,
    piece: u32,
    cmds: Vec<Cmd>,
    graph: Option<CudaGraph>,
}

// SAFETY: the graphs' driver handles are used only through `&mut CudaReplays` (one thread
// at a time), which is all the driver asks of graph objects.
unsafe impl Send for CudaReplays {}

impl CudaReplays {
    /// Graphs held (for tests and accounting).
    pub fn graphs(&self) -> usize {
        self.entries.iter().filter(|e| e.graph.is_some()).count()
    }
}

/// Whether this thread is inside a step (of any device): steps do not nest.
pub(crate) fn in_step() -> bool {
    RECORDING.with(|r| r.borrow().is_some())
}

/// Runs `f` recording its stream operations for `device`, then issues them: each piece by
/// replaying the graph captured for it when the same list was seen before, else directly.
pub(crate) fn replay<R>(
    device: &Arc<Device>,
    capture: &Arc<CudaStream>,
    replays: &mut CudaReplays,
    key: u64,
    f: impl FnOnce() -> R,
) -> Result<R> {
    RECORDING.with(|r| {
        *r.borrow_mut() = Some(Recording {
            device: Arc::as_ptr(device),
            cmds: Vec::with_capacity(FIRST_PIECE),
            flushed: false,
            key,
            piece: 0,
            replays: std::mem::take(replays),
            capture: capture.clone(),
        })
    });
    // Gives the graphs back to the stage even when `f` unwinds.
    let restore = Restore { replays };
    let out = f();
    let rec = RECORDING.with(|r| r.borrow_mut().take());
    let Some(mut rec) = rec else {
        return Ok(out);
    };
    *restore.replays = std::mem::take(&mut rec.replays);
    if rec.flushed {
        // Part ran eagerly; issue the rest the same way.
        device.bind()?;
        rec.cmds.iter().try_for_each(|c| c.issue(&device.stream))?;
        return Ok(out);
    }
    if !rec.cmds.is_empty() {
        issue_piece(device, capture, restore.replays, key, rec.piece, rec.cmds)?;
    }
    Ok(out)
}

/// Puts a step's graphs back where they came from if the step did not.
struct Restore<'a> {
    replays: &'a mut CudaReplays,
}

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        if let Some(rec) = RECORDING.with(|r| r.borrow_mut().take()) {
            *self.replays = rec.replays;
        }
    }
}

/// Issues piece `piece` of the step `key`: through its graph when `cmds` equals what the
/// piece held last time, else directly.
fn issue_piece(
    device: &Device,
    capture: &Arc<CudaStream>,
    replays: &mut CudaReplays,
    key: u64,
    piece: u32,
    cmds: Vec<Cmd>,
) -> Result<()> {
    device.bind()?;
    let at = match replays
        .entries
        .iter()
        .position(|e| e.key == key && e.piece == piece)
    {
        Some(i) => i,
        None => {
            if replays.entries.len() == MAX_ENTRIES {
                replays.entries.remove(0);
            }
            replays.entries.push(Entry {
                key,
                piece,
                cmds: Vec::new(),
                graph: None,
            });
            replays.entries.len() - 1
        }
    };
    let entry = &mut replays.entries[at];
    if entry.cmds != cmds {
        // New or changed: run it directly, and capture it if it comes again unchanged.
        entry.graph = None;
        cmds.iter().try_for_each(|c| c.issue(&device.stream))?;
        entry.cmds = cmds;
        return Ok(());
    }
    if entry.graph.is_none() {
        match capture_graph(capture, &cmds) {
            Ok(g) => entry.graph = Some(g),
            Err(_) => {
                // Graphs are an optimisation: without one the step still runs.
                entry.cmds.clear();
                return cmds.iter().try_for_each(|c| c.issue(&device.stream));
            }
        }
    }
    let Some(graph) = entry.graph.as_ref() else {
        return cmds.iter().try_for_each(|c| c.issue(&device.stream));
    };
    // SAFETY: the executable graph is alive (owned by `entry`), and launching it on the
    // backend's stream orders it after every operation issued before, like the commands
    // it was captured from.
    unsafe { result::graph::launch(graph.cu_graph_exec(), device.stream.cu_stream()) }
        .map_err(|e| driver_err("launching a captured decode step", e))
}

/// Captures `cmds` on the side stream `capture` (capturing issues nothing).
fn capture_graph(capture: &Arc<CudaStream>, cmds: &[Cmd]) -> Result<CudaGraph> {
    capture
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| driver_err("starting a graph capture", e))?;
    let issued = cmds.iter().try_for_each(|c| c.issue(capture));
    let ended = capture.end_capture(CUgraphInstantiate_flags(0));
    issued?;
    ended
        .map_err(|e| driver_err("instantiating a captured decode step", e))?
        .ok_or_else(|| {
            crate::error::ComputeError::Device("a graph capture recorded nothing".to_string())
        })
}
