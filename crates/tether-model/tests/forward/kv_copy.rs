//! Copying a sequence's first positions into another sequence (prefix reuse): the copy then
//! continues exactly as the source would, for every KV cache type, and a refused copy
//! changes nothing.

use tether_compute::CpuBackend;
use tether_gguf::GgmlType;
use tether_model::{BatchToken, SynthShape, load_stage_from_file};

use crate::support::{TempModel, backend, run, spec, synth};

const IDS: [u32; 12] = [1, 300, 17, 260, 45, 299, 3, 270, 288, 100, 7, 42];
const OTHER: [u32; 9] = [5, 6, 7, 8, 9, 10, 11, 12, 13];

fn at(seq: u32, positions: std::ops::Range<u32>) -> Vec<BatchToken> {
    positions.map(|pos| BatchToken { seq, pos }).collect()
}

fn stage(m: &TempModel, cache: GgmlType) -> tether_model::Stage<CpuBackend> {
    let n = tether_model::ModelConfig::from_gguf(&m.file)
        .unwrap()
        .n_layer;
    let mut s = spec(0, n, true, true, 3, 16);
    s.cache_k = cache;
    s.cache_v = cache;
    load_stage_from_file(backend(), &m.file, s).unwrap()
}

#[test]
fn a_copied_prefix_continues_as_its_source_does() {
    let m = synth(SynthShape::Tiny, GgmlType::Q8_0, 3);
    for cache in [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0] {
        let mut st = stage(&m, cache);
        run(&mut st, &IDS, &at(0, 0..12));
        // The destination held something else: the copy replaces it.
        run(&mut st, &OTHER, &at(2, 0..9));
        st.kv_truncate(0, 7).unwrap();
        let want = run(&mut st, &IDS[7..], &at(0, 7..12));
        st.kv_copy(0, 2, 7).unwrap();
        assert_eq!(st.seq_len(2).unwrap(), 7);
        assert_eq!(
            st.seq_len(0).unwrap(),
            12,
            "{cache}: the source keeps its cells"
        );
        let got = run(&mut st, &IDS[7..], &at(2, 7..12));
        assert_eq!(got, want, "{cache}: the copy goes on as its source");
    }
}

#[test]
fn a_refused_copy_changes_nothing() {
    let m = synth(SynthShape::Tiny, GgmlType::Q8_0, 3);
    let mut st = stage(&m, GgmlType::F16);
    run(&mut st, &IDS[..4], &at(0, 0..4));
    run(&mut st, &OTHER[..3], &at(1, 0..3));
    for (src, dst, len) in [(0, 1, 5), (0, 0, 2), (0, 3, 2), (3, 1, 0)] {
        let err = st.kv_copy(src, dst, len).unwrap_err().to_string();
        assert!(!err.is_empty());
        assert_eq!(
            (st.seq_len(0).unwrap(), st.seq_len(1).unwrap()),
            (4, 3),
            "copy {src} -> {dst} of {len}: {err}"
        );
    }
    st.kv_copy(0, 1, 0).unwrap();
    assert_eq!(
        st.seq_len(1).unwrap(),
        0,
        "an empty copy empties the destination"
    );
}

/// Token ids of a prompt longer than a KV block.
fn long_prompt(n: u32, salt: u32) -> Vec<u32> {
    (0..n).map(|i| (i * 37 + salt * 11) % 290 + 3).collect()
}

#[test]
fn shared_blocks_are_copied_before_either_sequence_writes_into_them() {
    let m = synth(SynthShape::Tiny, GgmlType::Q8_0, 4);
    let (a, b) = (long_prompt(56, 0), long_prompt(56, 1));
    // What each continuation gives when its whole prompt is prefilled alone.
    let mut fresh = stage(&m, GgmlType::F16);
    let want_a = run(&mut fresh, &a[..48], &at(0, 0..48));
    fresh.kv_clear(0).unwrap();
    let mut b_mix = a[..36].to_vec();
    b_mix.extend(&b[36..50]);
    let want_b = run(&mut fresh, &b_mix, &at(0, 0..50));

    let mut st = stage(&m, GgmlType::F16);
    let (blocks, free) = st.kv_pool();
    assert_eq!(
        blocks,
        3 * 2,
        "3 sequences of 64 cells: 2 blocks of 32 each"
    );
    run(&mut st, &a[..50], &at(0, 0..50));
    // Sequence 1 takes 40 positions (its second block shared in part), sequence 2 takes
    // 32 (one whole block): neither takes a block of its own.
    st.kv_copy(0, 1, 40).unwrap();
    st.kv_copy(0, 2, 32).unwrap();
    assert_eq!(st.kv_pool(), (blocks, free - 2));
    // The source rewrites positions 36.. inside the block sequence 1 shares: it gets a
    // copy of that block first, so sequence 1 still reads the old positions 36..40.
    st.kv_truncate(0, 36).unwrap();
    let got_b = run(&mut st, &b[36..50], &at(0, 36..50));
    assert_eq!(st.kv_pool(), (blocks, free - 3));
    let got_a = run(&mut st, &a[40..48], &at(1, 40..48));
    let n_vocab = got_a.len() / 8;
    assert_eq!(
        got_a,
        want_a[40 * n_vocab..],
        "the shared prefix kept its cells"
    );
    assert_eq!(got_b, want_b[36 * n_vocab..], "the rewritten source");
    // Sequence 2 goes on from its whole shared block into a block of its own.
    let got_2 = run(&mut st, &a[32..48], &at(2, 32..48));
    assert_eq!(got_2, want_a[32 * n_vocab..]);
    // Letting go of every sequence frees every block.
    for s in 0..3 {
        st.kv_clear(s).unwrap();
    }
    assert_eq!(st.kv_pool(), (blocks, blocks));
}
