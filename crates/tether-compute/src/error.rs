//! Errors of the compute backends.

/// What went wrong in a backend call.
#[derive(Debug, thiserror::Error)]
pub enum ComputeError {
    /// The device could not give the memory asked for.
    #[error("out of device memory on {device}: requested {requested} bytes, {free} bytes free")]
    OutOfMemory {
        /// The device that refused.
        device: String,
        /// Bytes asked for.
        requested: u64,
        /// Bytes the device reported free.
        free: u64,
    },
    /// An op was given sizes that do not match its buffers.
    #[error("shape error in {op}: {detail}")]
    Shape {
        /// The op that refused.
        op: &'static str,
        /// What did not fit.
        detail: String,
    },
    /// The op does not support this weight or cache type on this backend.
    #[error("{op} does not support type {ty} on {backend}")]
    Unsupported {
        /// The op.
        op: &'static str,
        /// The element type.
        ty: tether_gguf::GgmlType,
        /// The backend.
        backend: String,
    },
    /// Memory cannot be lent or borrowed between these backends (a cpu backend, another
    /// machine's area, a driver that refused to open it): hidden states go through the host.
    #[error("device memory cannot be shared: {0}")]
    NotShared(String),
    /// The backend is not available on this machine (no driver, no device).
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    /// The device failed in a way no driver error describes (a capture that recorded
    /// nothing, a host buffer of the wrong kind, a kernel missing from its module).
    #[error("device error: {0}")]
    Device(String),
    /// The CUDA driver refused a call; its error is kept as the source, so a caller can
    /// tell e.g. an illegal address from a launch failure.
    #[cfg(feature = "cuda")]
    #[error("device error: {what}: CUDA driver error {:?}", source.0)]
    Driver {
        /// What was being done.
        what: String,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// NVRTC could not compile a kernel file; the compiler's error is kept as the source.
    #[cfg(feature = "cuda")]
    #[error("device error: {what}: {source}")]
    Compile {
        /// Which file, for which device, with which NVRTC.
        what: String,
        /// The compiler's error (with its log).
        #[source]
        source: cudarc::nvrtc::CompileError,
    },
}
