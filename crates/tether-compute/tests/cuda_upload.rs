//! Overlapped weight uploads (pinned buffers, several copy streams) on the CUDA backend:
//! every byte lands where a plain upload puts it, and a run dropped with copies in flight
//! waits for them.
//!
//! Needs a GPU; ignored by default: `cargo test -p tether-compute --test cuda_upload --
//! --ignored --test-threads=1`.

use tether_compute::Backend;

mod common;
use common::{Rng, gpu};

fn random_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn overlapped_uploads_land_every_byte() {
    let g = gpu();
    let mut rng = Rng(41);
    let total = (40 << 20) + 12_345;
    let bytes = random_bytes(&mut rng, total);
    let mut buf = g.alloc(total).unwrap();
    let mut uploads = g.begin_uploads().unwrap();
    // Pieces smaller than, equal to and spanning several 8 MiB pinned buffers, at odd
    // offsets, more than the buffers there are (so buffers are reused).
    let cuts = [0, 1, 4_097, 8 << 20, (8 << 20) + 3, 30 << 20, total];
    for w in cuts.windows(2) {
        g.upload_weight(&mut uploads, &mut buf, w[0], &bytes[w[0]..w[1]])
            .unwrap();
    }
    g.finish_uploads(uploads).unwrap();
    let mut back = vec![0u8; total];
    g.download(&buf, 0, &mut back).unwrap();
    let first_bad = back.iter().zip(&bytes).position(|(a, b)| a != b);
    assert_eq!(first_bad, None, "the uploaded bytes differ");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_run_dropped_in_flight_waits_and_the_device_stays_usable() {
    let g = gpu();
    let mut rng = Rng(42);
    let total = 64 << 20;
    let bytes = random_bytes(&mut rng, total);
    let mut buf = g.alloc(total).unwrap();
    let mut uploads = g.begin_uploads().unwrap();
    g.upload_weight(&mut uploads, &mut buf, 0, &bytes).unwrap();
    // A load that fails half way drops its uploads before its weights.
    drop(uploads);
    drop(buf);
    let mut other = g.alloc(1 << 20).unwrap();
    g.upload(&mut other, 0, &bytes[..1 << 20]).unwrap();
    let mut back = vec![0u8; 1 << 20];
    g.download(&other, 0, &mut back).unwrap();
    assert!(back == bytes[..1 << 20]);
    assert!(
        g.upload_weight(
            &mut g.begin_uploads().unwrap(),
            &mut other,
            1,
            &bytes[..1 << 20]
        )
        .is_err(),
        "an upload past the buffer's end is refused"
    );
}
