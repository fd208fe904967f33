//! Giving freed host memory back to the operating system.

/// Returns the free pages of every malloc arena to the OS. A session's host buffers (cpu
/// weights, KV, scratch) are large and freed together; without this, glibc keeps them in
/// per-thread arenas and the worker's RSS stays at its high-water mark after the session
/// has gone, which reads as a leak to operators watching the process.
pub fn return_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}
