//! Throughput of the matmul kernels on llama3-1b shapes. Not run by default:
//! `cargo test -p tether-compute --release bench_matmul -- --ignored --nocapture`
//! (`BENCH_TYPES=q4_0,q4_K` picks types; `RAYON_NUM_THREADS=1` times one core;
//! `BENCH_HOT=1` reuses one weight matrix; `TETHER_CPU_ISA=avx2` times a lower kernel
//! level).
//!
//! Besides wall time it prints the CPU time the process spent, from the scheduler's
//! per-thread counters: on a machine shared with other work that number moves much less
//! than wall time, so it is the one to compare kernels by there.

use std::time::Instant;

use super::*;
use crate::cpu::test_util::{Rng, random_f32, random_weights};

/// Nanoseconds every thread of this process has run on a CPU (Linux; 0 elsewhere).
fn process_cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

#[test]
#[ignore = "benchmark; run by hand"]
fn bench_matmul() {
    let mut rng = Rng::new(9);
    let (rows, cols) = (8192, 2048);
    let filter = std::env::var("BENCH_TYPES").unwrap_or_default();
    let isa = CpuIsa::from_env().expect("TETHER_CPU_ISA names a level this CPU has");
    eprintln!("kernel level {isa}");
    for ty in GgmlType::ALL {
        if !filter.is_empty() && !filter.split(',').any(|f| f.eq_ignore_ascii_case(ty.name())) {
            continue;
        }
        // Several copies, more than the last-level cache holds, so decode timings include
        // streaming the weights from memory as a real model does.
        let one = random_weights(&mut rng, ty, rows * cols);
        // `BENCH_HOT=1` keeps one copy: the weights then come from cache, which separates
        // the kernel's arithmetic from memory bandwidth.
        let hot = std::env::var_os("BENCH_HOT").is_some();
        let copies = if hot { 1 } else { (96 << 20) / one.len() + 1 };
        // Q4_0 is timed in the file's layout and packed as `finish_weight` leaves it.
        let layouts: &[bool] = if cfg!(target_arch = "x86_64") && ty == GgmlType::Q4_0 {
            &[false, true]
        } else {
            &[false]
        };
        for &packed in layouts {
            let mut ws: Vec<Vec<u8>> = (0..copies).map(|_| one.clone()).collect();
            #[cfg(target_arch = "x86_64")]
            if packed {
                ws.iter_mut()
                    .for_each(|w| pack_q4_0(w, cols / 32 * ty.block_bytes()));
            }
            let product = |w: &[u8], x: &[f32], n: usize, out: &mut [f32]| {
                let s = Shape {
                    rows,
                    cols,
                    n_tokens: n,
                };
                #[cfg(target_arch = "x86_64")]
                if packed {
                    return matmul_packed(isa, w, s, x, out);
                }
                matmul(isa, ty, w, s, x, out)
            };
            for n_tokens in [1usize, 64] {
                let x = random_f32(&mut rng, n_tokens * cols, 1.0);
                let mut out = vec![0.0f32; rows * n_tokens];
                let ran = product(&ws[0], &x, n_tokens, &mut out);
                let reps = if n_tokens == 1 { 40 } else { 4 };
                let cpu0 = process_cpu_ns();
                let start = Instant::now();
                for i in 0..reps {
                    product(&ws[i % copies], &x, n_tokens, &mut out);
                }
                let secs = start.elapsed().as_secs_f64() / reps as f64;
                let cpu_ms = (process_cpu_ns() - cpu0) as f64 / 1e6 / reps as f64;
                let gmacs = (rows * cols * n_tokens) as f64 / secs / 1e9;
                let gbs = one.len() as f64 / secs / 1e9;
                let layout = if packed { ", packed" } else { "" };
                eprintln!(
                    "{ty:5} tokens={n_tokens:3} ({ran}{layout}): {:8.3} ms  {gmacs:7.1} GMAC/s  {gbs:6.1} GB/s weights  {cpu_ms:8.3} cpu-ms",
                    secs * 1e3
                );
            }
        }
    }
}
