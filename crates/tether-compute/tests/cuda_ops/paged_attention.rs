//! Attention over a paged cache (`KvCache::paged`): spans of virtual cells placed through a
//! block table that scatters and shares blocks, on every kernel (per-token decode, tiled
//! prefill, flash; run the binary again with TETHER_FLASH_ATTENTION=0 for the CUDA-core
//! tiled kernel), against the cpu, whose paged reads a cpu unit test checks against a
//! plain cache.

use super::attention::{attention_agrees, filled_caches};
use crate::*;
use tether_compute::{KV_BLOCK_CELLS, KvCache};

/// Blocks of virtual cells per sequence, and sequences.
const PER_SEQ: u32 = 5;
const N_SEQ: u32 = 3;

/// Each sequence's blocks, scattered over the cache's 15 blocks; sequence 2 shares its
/// first two blocks with sequence 0, so blocks 13 and 14 are no sequence's.
const TABLE: [u32; 15] = [7, 2, 11, 0, 9, 4, 12, 1, 10, 3, 7, 2, 6, 8, 5];

/// The virtual span of position `pos` of `seq` (as the model's KV bookkeeping makes it).
fn span(seq: u32, pos: u32) -> AttnSpan {
    AttnSpan {
        first_cell: seq * PER_SEQ * KV_BLOCK_CELLS,
        n_cells: pos + 1,
    }
}

/// Batches that exercise each path: one decode token, a few decode tokens of different
/// sequences, a prefill chunk of one sequence (tiled and flash kernels), a long one, and a
/// prefill of interleaved sequences with an odd token count.
fn batches() -> Vec<(&'static str, Vec<AttnSpan>)> {
    vec![
        ("decode", vec![span(1, 150)]),
        (
            "decode of three sequences",
            vec![span(0, 3), span(2, 77), span(1, 36)],
        ),
        ("prefill chunk", (0..8).map(|i| span(2, 120 + i)).collect()),
        (
            "long prefill chunk",
            (0..40).map(|i| span(0, 33 + i)).collect(),
        ),
        (
            "interleaved prefill",
            (0..23).map(|i| span(i % N_SEQ, 50 + i / N_SEQ)).collect(),
        ),
    ]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_attention_matches_cpu_on_every_kernel() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(23);
    let table_bytes: Vec<u8> = TABLE.iter().flat_map(|e| e.to_le_bytes()).collect();
    let table = pair(&g, &c, &table_bytes);
    let n_cells = (TABLE.len() as u32 * KV_BLOCK_CELLS) as usize;
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
                ring_cells: 0,
            };
            let kv_dim = n_kv_heads * head_dim;
            let (k, v) = filled_caches(&g, &c, &mut rng, ty, kv_dim, n_cells);
            for (name, spans) in batches() {
                let what = format!("paged attention {name}");
                let caches = (&k, &v, Some(&table));
                attention_agrees((&g, &c), &mut rng, caches, ty, shape, (&what, &spans));
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn spans_past_the_block_table_are_refused() {
    let (g, c) = (gpu(), cpu());
    let shape = AttnShape {
        n_heads: 2,
        n_kv_heads: 2,
        head_dim: 64,
        ring_cells: 0,
    };
    let n_cells = (TABLE.len() as u32 * KV_BLOCK_CELLS) as usize;
    let q = pair(&g, &c, &vec![0u8; 2 * 64 * 4]);
    let kv = pair(&g, &c, &vec![0u8; n_cells * 2 * 64 * 2]);
    // A table of two entries names 64 virtual cells.
    let table = pair(&g, &c, &[0u8; 8]);
    let mut out = g.alloc(2 * 64 * 4).unwrap();
    let cache = KvCache::new(&kv.g, &kv.g, GgmlType::F16).paged(&table.g);
    let err = g.attention(&q.g, cache, &[span(0, 64)], shape, 1.0, &mut out);
    assert!(matches!(err, Err(ComputeError::Shape { .. })), "{err:?}");
    // A ring is never paged.
    let ring = AttnShape {
        ring_cells: 16,
        ..shape
    };
    let err = g.attention(&q.g, cache, &[span(0, 3)], ring, 1.0, &mut out);
    assert!(matches!(err, Err(ComputeError::Shape { .. })), "{err:?}");
    g.attention(&q.g, cache, &[span(0, 63)], shape, 1.0, &mut out)
        .unwrap();
}
