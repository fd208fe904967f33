//! Attention over sliding-window rings (`AttnShape::ring_cells`): spans of virtual cells that
//! wrap round each sequence's ring, on every kernel (per-token decode, tiled prefill, flash;
//! run the binary again with TETHER_FLASH_ATTENTION=0 for the CUDA-core tiled kernel),
//! against the cpu, and the cpu against the same attention over a plain cache.

use super::attention::{attention_agrees, filled_caches};
use crate::*;
use tether_compute::KvCache;

/// Rings of 37 cells (odd, so wraps fall anywhere in a tile) for 3 sequences, window 29.
const RING: u32 = 37;
const WINDOW: u32 = 29;
const N_SEQ: u32 = 3;

/// The virtual span of position `pos` of `seq` (as the model's KV bookkeeping makes it).
fn ring_span(seq: u32, pos: u32) -> AttnSpan {
    let start = pos.saturating_sub(WINDOW - 1);
    AttnSpan {
        first_cell: seq * 2 * RING + start % RING,
        n_cells: pos - start + 1,
    }
}

/// Batches that exercise each path: one decode token past many wraps, a few decode tokens
/// of different sequences, a prefill chunk of one sequence whose windows wrap (tiled and
/// flash kernels), and a prefill of interleaved sequences with an odd token count.
fn batches() -> Vec<(&'static str, Vec<AttnSpan>)> {
    vec![
        ("decode", vec![ring_span(1, 1000)]),
        (
            "decode of three sequences",
            vec![ring_span(0, 3), ring_span(2, 77), ring_span(1, 36)],
        ),
        (
            "prefill chunk",
            (0..8).map(|i| ring_span(2, 120 + i)).collect(),
        ),
        (
            "long prefill chunk",
            (0..40).map(|i| ring_span(0, 33 + i % 8)).collect(),
        ),
        (
            "interleaved prefill",
            (0..23)
                .map(|i| ring_span(i % N_SEQ, 50 + i / N_SEQ))
                .collect(),
        ),
    ]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ring_attention_matches_cpu_on_every_kernel() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(21);
    for ty in [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0] {
        for (n_heads, n_kv_heads, head_dim) in [
            (8usize, 2usize, 64usize),
            (4, 4, 128),
            (6, 3, 96),
            (8, 4, 256),
        ] {
            let shape = AttnShape {
                n_heads,
                n_kv_heads,
                head_dim,
                ring_cells: RING,
            };
            let kv_dim = n_kv_heads * head_dim;
            let (k, v) = filled_caches(&g, &c, &mut rng, ty, kv_dim, (N_SEQ * RING) as usize);
            for (name, spans) in batches() {
                let what = format!("ring attention {name}");
                let caches = (&k, &v, None);
                attention_agrees((&g, &c), &mut rng, caches, ty, shape, (&what, &spans));
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ring_spans_that_leave_their_sequence_are_refused() {
    let (g, c) = (gpu(), cpu());
    let shape = AttnShape {
        n_heads: 2,
        n_kv_heads: 2,
        head_dim: 64,
        ring_cells: RING,
    };
    let cache_bytes = (N_SEQ * RING) as usize * 2 * 64 * 2;
    let q = pair(&g, &c, &vec![0u8; 2 * 64 * 4]);
    let kv = pair(&g, &c, &vec![0u8; cache_bytes]);
    let mut out = g.alloc(2 * 64 * 4).unwrap();
    for bad in [
        // Longer than a ring.
        AttnSpan {
            first_cell: 0,
            n_cells: RING + 1,
        },
        // Crossing into the next sequence's virtual cells.
        AttnSpan {
            first_cell: 2 * RING - 3,
            n_cells: 5,
        },
        // Past the last sequence.
        AttnSpan {
            first_cell: N_SEQ * 2 * RING,
            n_cells: 1,
        },
    ] {
        let err = g.attention(
            &q.g,
            KvCache::new(&kv.g, &kv.g, GgmlType::F16),
            &[bad],
            shape,
            1.0,
            &mut out,
        );
        assert!(
            matches!(err, Err(ComputeError::Shape { .. })),
            "{bad:?}: {err:?}"
        );
    }
}
