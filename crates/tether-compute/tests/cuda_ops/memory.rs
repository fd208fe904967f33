//! Device memory: transfers, allocation and freeing, and what NVML counts.

use crate::*;

#[test]
#[ignore = "needs a CUDA GPU"]
fn transfers_are_bounds_checked_and_round_trip() {
    let g = gpu();
    let mut b = g.alloc(16).unwrap();
    g.upload(&mut b, 4, &[1, 2, 3, 4]).unwrap();
    let mut back = [9u8; 6];
    g.download(&b, 3, &mut back).unwrap();
    assert_eq!(back, [0, 1, 2, 3, 4, 0]);
    assert!(matches!(
        g.upload(&mut b, 13, &[0; 4]),
        Err(ComputeError::Shape { .. })
    ));
    assert!(matches!(
        g.download(&b, 10, &mut [0; 7]),
        Err(ComputeError::Shape { .. })
    ));
    assert!(g.name().starts_with("cuda:0"), "{}", g.name());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn alloc_free_cycles_return_the_memory() {
    let g = gpu();
    g.synchronize().unwrap();
    let start = g.memory_info().unwrap();
    let base = g.allocated_bytes();
    assert!(start.free > 0 && start.free <= start.total);
    for i in 0..1000usize {
        let b = g.alloc((1 << 20) + i * 4096).unwrap();
        assert_eq!(g.allocated_bytes(), base + b.bytes() as u64);
        drop(b);
    }
    assert_eq!(g.allocated_bytes(), base);
    g.synchronize().unwrap();
    let end = g.memory_info().unwrap();
    let drift = start.free.abs_diff(end.free);
    assert!(drift <= 16 << 20, "free memory moved by {drift} bytes");
    let too_much = usize::try_from(start.total * 2).unwrap();
    assert!(matches!(
        g.alloc(too_much),
        Err(ComputeError::OutOfMemory { .. })
    ));
}

/// NVML's count of this process's device memory follows an allocation up and back down,
/// which is what lets a worker tell its own leaks from another process on the same GPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn process_memory_follows_allocations() {
    let g = gpu();
    g.synchronize().unwrap();
    let before = g
        .process_memory()
        .expect("NVML lists this process (libnvidia-ml present, same pid namespace)");
    let b = g.alloc(512 << 20).unwrap();
    let during = g.process_memory().expect("still listed");
    let grew = during.saturating_sub(before);
    assert!(
        (512 << 20..=(512 + 32) << 20).contains(&grew),
        "a 512 MiB buffer moved NVML's count by {grew} bytes"
    );
    drop(b);
    g.synchronize().unwrap();
    let after = g.process_memory().expect("still listed");
    assert!(
        after.abs_diff(before) <= 2 << 20,
        "NVML's count went from {before} to {after} across alloc and free"
    );
}

/// Buffers reserved together share one allocation: each holds its own bytes, they do not
/// overlap, and the memory returns when the last of them is dropped.
#[test]
#[ignore = "needs a CUDA GPU"]
fn alloc_many_buffers_are_separate_and_freed_with_the_last() {
    let g = gpu();
    let base = g.allocated_bytes();
    let sizes = [100usize, 0, 5000, 1 << 20, 256];
    let mut bufs = g.alloc_many(&sizes).unwrap();
    assert_eq!(bufs.len(), sizes.len());
    for (b, &s) in bufs.iter().zip(&sizes) {
        assert_eq!(b.bytes(), s);
    }
    let held = g.allocated_bytes() - base;
    let aligned: usize = sizes.iter().map(|s| s.next_multiple_of(256)).sum();
    assert_eq!(held, aligned as u64, "one allocation of the aligned sizes");
    // Fill each with its own byte, then read all back: no buffer spills into another.
    for (i, b) in bufs.iter_mut().enumerate() {
        let fill = vec![i as u8 + 1; b.bytes()];
        g.upload(b, 0, &fill).unwrap();
    }
    for (i, b) in bufs.iter().enumerate() {
        let mut back = vec![0u8; b.bytes()];
        g.download(b, 0, &mut back).unwrap();
        assert!(back.iter().all(|&x| x == i as u8 + 1), "buffer {i}");
    }
    let last = bufs.pop().unwrap();
    drop(bufs);
    assert_eq!(
        g.allocated_bytes() - base,
        held,
        "held while one part lives"
    );
    drop(last);
    assert_eq!(g.allocated_bytes(), base, "freed with the last part");
}
