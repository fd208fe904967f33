use super::frame::*;
use crate::error::WorkerError;
use crate::forward::{ForwardCall, ForwardInput, ForwardOutput, Rows, SharedArea, TokenPos};
use crate::ids::SessionId;
use std::time::Duration;
use tonic::Code;

fn body(frame: &[u8]) -> &[u8] {
    let len = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
    assert_eq!(len, frame.len() - 4, "the length prefix covers the body");
    &frame[4..]
}

fn calls() -> Vec<ForwardCall> {
    let tokens = vec![TokenPos { seq: 0, pos: 7 }, TokenPos { seq: 3, pos: 1 }];
    vec![
        ForwardCall {
            tokens: tokens.clone(),
            input: ForwardInput::TokenIds(vec![5, u32::MAX]),
            logits_rows: vec![],
            rows: Rows::Logits,
            targets: Vec::new(),
        },
        ForwardCall {
            tokens: tokens.clone(),
            input: ForwardInput::Hidden(vec![1.5, -0.0, f32::INFINITY, 3e-41]),
            logits_rows: vec![1],
            rows: Rows::ArgMax,
            targets: Vec::new(),
        },
        ForwardCall {
            tokens: tokens.clone(),
            input: ForwardInput::Hidden(vec![]),
            logits_rows: vec![0, 1],
            rows: Rows::Top(40),
            targets: Vec::new(),
        },
        ForwardCall {
            tokens: tokens.clone(),
            input: ForwardInput::TokenIds(vec![4, 6]),
            logits_rows: vec![0, 1],
            rows: Rows::LogProbs(0),
            targets: vec![6, 11],
        },
        ForwardCall {
            tokens: tokens.clone(),
            input: ForwardInput::TokenIds(vec![4, 6]),
            logits_rows: vec![0, 1],
            rows: Rows::Embeddings,
            targets: Vec::new(),
        },
        ForwardCall {
            tokens: tokens.clone(),
            input: ForwardInput::Hidden(vec![0.5; 4]),
            logits_rows: vec![],
            rows: Rows::HandOff(2),
            targets: Vec::new(),
        },
        ForwardCall {
            tokens,
            input: ForwardInput::Lent(area()),
            logits_rows: vec![1],
            rows: Rows::ArgMax,
            targets: Vec::new(),
        },
    ]
}

/// A lent range whose every field differs from its neighbours', so a field read in the
/// wrong place shows.
fn area() -> SharedArea {
    let mut handle = [0u8; 64];
    for (i, b) in handle.iter_mut().enumerate() {
        *b = 255 - i as u8;
    }
    SharedArea {
        host: *b"0123456789abcdef",
        pid: 4_000_001,
        device: 1,
        handle,
        base: 0x7f00_0000_0000,
        key: 0x0123_4567_89ab_cdef,
        offset: 3 << 20,
        len: 8 << 20,
    }
}

fn outputs() -> Vec<ForwardOutput> {
    vec![
        ForwardOutput::Hidden(vec![0.25, -7.0]),
        ForwardOutput::Logits(vec![f32::NEG_INFINITY, 2.0, 1e30]),
        ForwardOutput::ArgMax(vec![0, 128_255]),
        ForwardOutput::Top {
            counts: vec![2, 0, 1],
            candidates: vec![(9, 3.5), (2, 3.5), (1, -1.0)],
        },
        ForwardOutput::Scored {
            counts: vec![1, 0],
            candidates: vec![(4, 0.5)],
            scores: vec![(2.25, -1.0), (f32::NEG_INFINITY, 7.0)],
        },
        ForwardOutput::Embeddings(vec![0.5, -0.25, 1e-3, 4.0]),
        ForwardOutput::Lent(area()),
    ]
}

#[test]
fn requests_and_replies_survive_the_round_trip() {
    for call in calls() {
        let f = encode_forward(&call);
        assert_eq!(decode_forward(body(&f)), Ok(call));
    }
    for out in outputs() {
        let f = encode_output(&Ok(out.clone()));
        assert_eq!(decode_output(body(&f)), Ok(Ok(out)));
    }
    let nan = encode_output(&Ok(ForwardOutput::Hidden(vec![f32::NAN])));
    match decode_output(body(&nan)) {
        Ok(Ok(ForwardOutput::Hidden(h))) => assert!(h.len() == 1 && h[0].is_nan()),
        other => panic!("NaN did not survive: {other:?}"),
    }
}

#[test]
fn worker_errors_keep_their_kind_and_message() {
    let cases = [
        (WorkerError::NotFound("no session x".into()), Code::NotFound),
        (
            WorkerError::InvalidArgument("bad".into()),
            Code::InvalidArgument,
        ),
        (
            WorkerError::LocalFile("no dir".into()),
            Code::FailedPrecondition,
        ),
        (
            WorkerError::OverLimit("too many".into()),
            Code::ResourceExhausted,
        ),
        (
            WorkerError::Unavailable("leaving".into()),
            Code::Unavailable,
        ),
        (WorkerError::Internal("cuda said no".into()), Code::Internal),
    ];
    for (e, code) in cases {
        let f = encode_output(&Err(e.clone()));
        assert_eq!(
            decode_output(body(&f)),
            Ok(Err(Refusal {
                code,
                message: e.to_string()
            }))
        );
    }
}

#[test]
fn hellos_and_welcomes_round_trip() {
    let id = SessionId::new_random();
    let f = encode_hello(id, b"s3cret");
    assert_eq!(
        decode_hello(body(&f)),
        Ok(Hello {
            session: id,
            token: b"s3cret".to_vec()
        })
    );
    let f = encode_welcome(Ok(Duration::from_millis(10)));
    assert_eq!(decode_welcome(body(&f)), Ok(Ok(Duration::from_millis(10))));
    let f = encode_welcome(Err((Code::Unauthenticated, "wrong token".into())));
    assert_eq!(
        decode_welcome(body(&f)),
        Ok(Err(Refusal {
            code: Code::Unauthenticated,
            message: "wrong token".into()
        }))
    );
}

#[test]
fn every_truncation_and_every_extra_byte_is_refused() {
    type Refused = fn(&[u8]) -> bool;
    let mut frames: Vec<(Vec<u8>, Refused)> = Vec::new();
    for call in calls() {
        frames.push((encode_forward(&call), |b| decode_forward(b).is_err()));
    }
    for out in outputs() {
        frames.push((encode_output(&Ok(out)), |b| decode_output(b).is_err()));
    }
    frames.push((encode_hello(SessionId::new_random(), b"t"), |b| {
        decode_hello(b).is_err()
    }));
    for (f, refused) in frames {
        let b = body(&f);
        for cut in 0..b.len() {
            assert!(
                refused(&b[..cut]),
                "a frame cut to {cut} of {} bytes was taken",
                b.len()
            );
        }
        let mut long = b.to_vec();
        long.push(0);
        assert!(refused(&long), "a frame with a trailing byte was taken");
    }
}

#[test]
fn hostile_counts_unknown_kinds_and_foreign_hellos_are_clear_errors() {
    // Four billion tokens announced in a 9-byte frame: refused before allocating.
    let mut huge = vec![1u8];
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    huge.extend_from_slice(&[0; 4]);
    let e = decode_forward(&huge).expect_err("a count beyond the frame");
    assert!(e.to_string().contains("ends early"), "{e}");

    let mut f = encode_forward(&calls()[0]);
    f[4] = 9;
    let e = decode_forward(body(&f)).expect_err("unknown request");
    assert!(e.to_string().contains("unknown request 9"), "{e}");

    let e = decode_output(&[0, 77]).expect_err("unknown output kind");
    assert!(e.to_string().contains("unknown output kind 77"), "{e}");
    let e = decode_output(&[200]).expect_err("unknown status");
    assert!(e.to_string().contains("unknown status 200"), "{e}");

    let mut h = encode_hello(SessionId::new_random(), b"");
    h[4..8].copy_from_slice(b"GET ");
    let e = decode_hello(body(&h)).expect_err("an HTTP request is not a hello");
    assert!(e.to_string().contains("not a tether data link"), "{e}");
    let long = encode_hello(SessionId::new_random(), &[b'a'; 5000]);
    let e = decode_hello(body(&long)).expect_err("a 5000-byte token");
    assert!(e.to_string().contains("5000-byte token"), "{e}");
}
