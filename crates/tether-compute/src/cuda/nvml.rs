//! Device memory held by one process, from NVML (libnvidia-ml, the library nvidia-smi reads),
//! loaded at run time like the CUDA driver.
//!
//! cuMemGetInfo tells what the whole device has in use, so another process on the same GPU
//! (a second worker, a training job) moves it; NVML's per-process figure does not. When the
//! library is missing, or lists no process with this one's pid (a container with its own pid
//! namespace sees host pids), callers fall back to cuMemGetInfo.

use std::ffi::{CString, c_char, c_int, c_uint, c_ulonglong, c_void};

type NvmlReturn = c_int;
type NvmlDevice = *mut c_void;

const NVML_SUCCESS: NvmlReturn = 0;
const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
/// `usedGpuMemory` when the driver cannot tell (for example without the right to see it).
const NVML_VALUE_NOT_AVAILABLE: u64 = u64::MAX;
/// More processes than any real GPU runs at once; a guard against a count that keeps growing.
const MAX_PROCESSES: usize = 4096;

/// `nvmlProcessInfo_v2_t`, what `nvmlDeviceGetComputeRunningProcesses_v3` fills.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

type RunningProcesses =
    unsafe extern "C" fn(NvmlDevice, *mut c_uint, *mut ProcessInfo) -> NvmlReturn;
type Shutdown = unsafe extern "C" fn() -> NvmlReturn;

/// An initialized NVML and the handle of one device; shut down on drop.
pub(crate) struct Nvml {
    device: NvmlDevice,
    running: RunningProcesses,
    shutdown: Shutdown,
    // Last, so the function pointers above are never used after the library is unloaded.
    _lib: libloading::Library,
}

// SAFETY: NVML is thread-safe (its documentation says every call may come from any thread);
// the device handle is an opaque token that NVML owns until nvmlShutdown.
unsafe impl Send for Nvml {}
// SAFETY: as above; `&self` methods only call thread-safe NVML functions.
unsafe impl Sync for Nvml {}

impl Nvml {
    /// Opens NVML for the device at `pci_bus_id` (as cuDeviceGetPCIBusId writes it), or
    /// `None` when the library, a function or the device is missing.
    pub(crate) fn open(pci_bus_id: &str) -> Option<Self> {
        let bus = CString::new(pci_bus_id).ok()?;
        // SAFETY: loading the driver's own management library runs only its initializers.
        let lib = ["libnvidia-ml.so.1", "libnvidia-ml.so"]
            .iter()
            .find_map(|name| unsafe { libloading::Library::new(*name) }.ok())?;
        // SAFETY: the symbols have these C signatures in every NVML since CUDA 11.
        unsafe {
            let init = *lib
                .get::<unsafe extern "C" fn() -> NvmlReturn>(b"nvmlInit_v2\0")
                .ok()?;
            let by_bus = *lib
                .get::<unsafe extern "C" fn(*const c_char, *mut NvmlDevice) -> NvmlReturn>(
                    b"nvmlDeviceGetHandleByPciBusId_v2\0",
                )
                .ok()?;
            let running = *lib
                .get::<RunningProcesses>(b"nvmlDeviceGetComputeRunningProcesses_v3\0")
                .ok()?;
            let shutdown = *lib.get::<Shutdown>(b"nvmlShutdown\0").ok()?;
            if init() != NVML_SUCCESS {
                return None;
            }
            let mut device: NvmlDevice = std::ptr::null_mut();
            if by_bus(bus.as_ptr(), &mut device) != NVML_SUCCESS {
                shutdown();
                return None;
            }
            Some(Self {
                device,
                running,
                shutdown,
                _lib: lib,
            })
        }
    }

    /// Device bytes process `pid` holds on this device, or `None` when NVML does not list it
    /// or cannot tell.
    pub(crate) fn process_used(&self, pid: u32) -> Option<u64> {
        let mut capacity = 32usize;
        loop {
            let mut list = vec![ProcessInfo::default(); capacity];
            let mut count = capacity as c_uint;
            // SAFETY: `list` has room for `count` entries; NVML writes at most that many.
            let r = unsafe { (self.running)(self.device, &mut count, list.as_mut_ptr()) };
            match r {
                NVML_SUCCESS => {
                    let n = (count as usize).min(capacity);
                    return list[..n]
                        .iter()
                        .find(|p| p.pid == pid)
                        .map(|p| p.used_gpu_memory)
                        .filter(|&b| b != NVML_VALUE_NOT_AVAILABLE);
                }
                // Processes started between the calls: ask again with more room.
                NVML_ERROR_INSUFFICIENT_SIZE if capacity < MAX_PROCESSES => {
                    capacity = (count as usize + 8).max(capacity * 2).min(MAX_PROCESSES);
                }
                _ => return None,
            }
        }
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: balances the nvmlInit_v2 of `open`; the library is still loaded.
        unsafe {
            (self.shutdown)();
        }
    }
}

/// The PCI bus id of a CUDA device ("0000:65:00.0"), which names it to NVML.
pub(crate) fn pci_bus_id(device: cudarc::driver::sys::CUdevice) -> Option<String> {
    let mut buf = [0 as c_char; 32];
    // SAFETY: the buffer holds `len` bytes; the driver writes a NUL-terminated string.
    let r = unsafe {
        cudarc::driver::sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as c_int, device)
    };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    // SAFETY: NUL-terminated within the buffer on success.
    let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    s.to_str().ok().map(str::to_owned)
}
