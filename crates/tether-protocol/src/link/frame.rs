//! The data link's wire format. Every frame is a little-endian `u32` body length and the
//! body. The client opens with a hello (magic, session id, token) and the worker answers
//! with a status; after that each request frame gets exactly one reply frame. A status is a
//! gRPC code in one byte (0 is success), so an error reaches the client with the kind a
//! gRPC call would give it.
//!
//! Decoding checks every count against the bytes that remain before it allocates, so a
//! hostile frame costs at most its own length.

use crate::error::WorkerError;
use crate::forward::{ForwardCall, ForwardInput, ForwardOutput, Rows, SharedArea, TokenPos};
use crate::grpc::code_of;
use crate::ids::SessionId;
use std::time::Duration;
use tonic::Code;
use uuid::Uuid;

/// First bytes of a hello; the digit is the link's protocol version.
pub(crate) const MAGIC: &[u8; 4] = b"TTD3";
/// Longest token a hello may carry.
const MAX_TOKEN_BYTES: usize = 4096;

const OP_FORWARD: u8 = 1;
const IN_IDS: u8 = 0;
const IN_HIDDEN: u8 = 1;
const IN_LENT: u8 = 2;
const ROWS_LOGITS: u8 = 0;
const ROWS_ARGMAX: u8 = 1;
const ROWS_TOP: u8 = 2;
const ROWS_LOGPROBS: u8 = 3;
const ROWS_EMBEDDINGS: u8 = 4;
const ROWS_HANDOFF: u8 = 5;
const OUT_HIDDEN: u8 = 0;
const OUT_LOGITS: u8 = 1;
const OUT_ARGMAX: u8 = 2;
const OUT_TOP: u8 = 3;
const OUT_SCORED: u8 = 4;
const OUT_EMBEDDINGS: u8 = 5;
const OUT_LENT: u8 = 6;

/// A frame's body, built in place behind room for its length.
pub(crate) struct Writer(Vec<u8>);

impl Writer {
    pub(crate) fn new() -> Self {
        Self::with_room(0)
    }

    /// A writer with room for `bytes` of body, so a frame of hidden states is written
    /// without growing its buffer.
    fn with_room(bytes: usize) -> Self {
        let mut v = Vec::with_capacity(bytes + 64);
        v.extend_from_slice(&[0; 4]);
        Self(v)
    }

    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }

    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn len_of(&mut self, n: usize) -> &mut Self {
        // Every list here is bounded by the frame limit, itself far below 4 GiB.
        self.u32(u32::try_from(n).unwrap_or(u32::MAX))
    }

    fn u32s(&mut self, v: &[u32]) -> &mut Self {
        self.len_of(v.len());
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
        self
    }

    fn f32s(&mut self, v: &[f32]) -> &mut Self {
        self.len_of(v.len());
        if cfg!(target_endian = "little") {
            // One copy: a hidden state between workers is MiBs, and the per-float loop cost
            // ~2 ms of a 512-token pass's 8 MiB.
            self.0.extend_from_slice(bytemuck::cast_slice(v));
        } else {
            self.0.reserve(v.len() * 4);
            self.0.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        }
        self
    }

    fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.0.extend_from_slice(v);
        self
    }

    fn area(&mut self, a: &SharedArea) -> &mut Self {
        self.bytes(&a.host)
            .u32(a.pid)
            .u32(a.device)
            .bytes(&a.handle);
        for v in [a.base, a.key, a.offset, a.len] {
            self.0.extend_from_slice(&v.to_le_bytes());
        }
        self
    }

    /// The whole frame, its length filled in.
    pub(crate) fn finish(mut self) -> Vec<u8> {
        let body = u32::try_from(self.0.len() - 4).unwrap_or(u32::MAX);
        self.0[..4].copy_from_slice(&body.to_le_bytes());
        self.0
    }
}

/// Reads a frame's body front to back; every read says what was short.
pub(crate) struct Reader<'a> {
    rest: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(body: &'a [u8], what: &'static str) -> Self {
        Self { rest: body, what }
    }

    fn short(&self, need: usize) -> WorkerError {
        WorkerError::InvalidArgument(format!(
            "{}: the frame ends early ({} bytes left, {need} needed)",
            self.what,
            self.rest.len()
        ))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WorkerError> {
        if self.rest.len() < n {
            return Err(self.short(n));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, WorkerError> {
        Ok(self.take(1)?[0])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WorkerError> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn area(&mut self) -> Result<SharedArea, WorkerError> {
        let host = self.array()?;
        let (pid, device) = (self.u32()?, self.u32()?);
        let handle = self.array()?;
        let mut u64s = [0u64; 4];
        for v in &mut u64s {
            *v = u64::from_le_bytes(self.array()?);
        }
        let [base, key, offset, len] = u64s;
        Ok(SharedArea {
            host,
            pid,
            device,
            handle,
            base,
            key,
            offset,
            len,
        })
    }

    fn u32(&mut self) -> Result<u32, WorkerError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A count of `width`-byte items, checked against what remains.
    fn count(&mut self, width: usize) -> Result<usize, WorkerError> {
        let n = self.u32()? as usize;
        let need = n.saturating_mul(width);
        if need > self.rest.len() {
            return Err(self.short(need));
        }
        Ok(n)
    }

    fn u32s(&mut self) -> Result<Vec<u32>, WorkerError> {
        let n = self.count(4)?;
        let b = self.take(n * 4)?;
        Ok(b.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    fn f32s(&mut self) -> Result<Vec<f32>, WorkerError> {
        let n = self.count(4)?;
        let b = self.take(n * 4)?;
        if cfg!(target_endian = "little") {
            let mut v = vec![0f32; n];
            bytemuck::cast_slice_mut::<f32, u8>(&mut v).copy_from_slice(b);
            return Ok(v);
        }
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    fn text(&mut self) -> String {
        let s = String::from_utf8_lossy(self.rest).into_owned();
        self.rest = &[];
        s
    }

    fn end(&self) -> Result<(), WorkerError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(WorkerError::InvalidArgument(format!(
                "{}: {} bytes after the end of the frame",
                self.what,
                self.rest.len()
            )))
        }
    }
}

/// What a client says first.
#[derive(Debug, PartialEq, Eq)]
pub struct Hello {
    pub session: SessionId,
    pub token: Vec<u8>,
}

pub fn encode_hello(session: SessionId, token: &[u8]) -> Vec<u8> {
    let mut w = Writer::new();
    w.bytes(MAGIC)
        .bytes(session.0.as_bytes())
        .u32(token.len() as u32)
        .bytes(token);
    w.finish()
}

pub fn decode_hello(body: &[u8]) -> Result<Hello, WorkerError> {
    let mut r = Reader::new(body, "data link hello");
    if r.take(4)? != MAGIC {
        return Err(WorkerError::InvalidArgument(
            "data link hello: not a tether data link (wrong magic or version)".into(),
        ));
    }
    let mut id = [0u8; 16];
    id.copy_from_slice(r.take(16)?);
    let n = r.u32()? as usize;
    if n > MAX_TOKEN_BYTES {
        return Err(WorkerError::InvalidArgument(format!(
            "data link hello: a {n}-byte token is longer than {MAX_TOKEN_BYTES}"
        )));
    }
    let token = r.take(n)?.to_vec();
    r.end()?;
    Ok(Hello {
        session: SessionId(Uuid::from_bytes(id)),
        token,
    })
}

/// The worker's answer to a hello: how long its side spins for the next request (the
/// client spins as long for replies), or why the link is refused.
pub fn encode_welcome(result: Result<Duration, (Code, String)>) -> Vec<u8> {
    let mut w = Writer::new();
    match result {
        Ok(spin) => w
            .u8(Code::Ok as u8)
            .u32(u32::try_from(spin.as_micros()).unwrap_or(u32::MAX)),
        Err((code, message)) => w.u8(code as u8).bytes(message.as_bytes()),
    };
    w.finish()
}

/// An error a worker sent, with its code.
#[derive(Debug, PartialEq, Eq)]
pub struct Refusal {
    pub code: Code,
    pub message: String,
}

impl Refusal {
    /// As the gRPC status a Forward call would have failed with.
    pub fn into_status(self) -> tonic::Status {
        tonic::Status::new(self.code, self.message)
    }
}

/// Decodes a reply's status: `Ok(Ok(reader))` for success with the rest to read,
/// `Ok(Err(refusal))` for a worker's error, `Err` for a malformed frame.
fn status<'a>(
    body: &'a [u8],
    what: &'static str,
) -> Result<Result<Reader<'a>, Refusal>, WorkerError> {
    let mut r = Reader::new(body, what);
    let b = r.u8()?;
    let code = Code::from(i32::from(b));
    if code == Code::Unknown && b != Code::Unknown as u8 {
        return Err(WorkerError::InvalidArgument(format!(
            "{what}: unknown status {b}"
        )));
    }
    if code == Code::Ok {
        return Ok(Ok(r));
    }
    Ok(Err(Refusal {
        code,
        message: r.text(),
    }))
}

pub fn decode_welcome(body: &[u8]) -> Result<Result<Duration, Refusal>, WorkerError> {
    match status(body, "data link welcome")? {
        Ok(mut r) => {
            let spin = Duration::from_micros(u64::from(r.u32()?));
            r.end()?;
            Ok(Ok(spin))
        }
        Err(refusal) => Ok(Err(refusal)),
    }
}

pub fn encode_forward(call: &ForwardCall) -> Vec<u8> {
    let input = match &call.input {
        ForwardInput::TokenIds(ids) => ids.len(),
        ForwardInput::Hidden(h) => h.len(),
        ForwardInput::Lent(_) => 0,
    };
    let mut w = Writer::with_room(4 * (input + call.logits_rows.len() + 2 * call.tokens.len()));
    w.u8(OP_FORWARD).len_of(call.tokens.len());
    for t in &call.tokens {
        w.u32(t.seq).u32(t.pos);
    }
    match &call.input {
        ForwardInput::TokenIds(ids) => w.u8(IN_IDS).u32s(ids),
        ForwardInput::Hidden(h) => w.u8(IN_HIDDEN).f32s(h),
        ForwardInput::Lent(a) => w.u8(IN_LENT).area(a),
    };
    w.u32s(&call.logits_rows);
    match call.rows {
        Rows::Logits => w.u8(ROWS_LOGITS).u32(0),
        Rows::ArgMax => w.u8(ROWS_ARGMAX).u32(0),
        Rows::Top(k) => w.u8(ROWS_TOP).u32(k),
        Rows::LogProbs(k) => w.u8(ROWS_LOGPROBS).u32(k),
        Rows::Embeddings => w.u8(ROWS_EMBEDDINGS).u32(0),
        Rows::HandOff(slot) => w.u8(ROWS_HANDOFF).u32(slot),
    };
    w.u32s(&call.targets);
    w.finish()
}

pub fn decode_forward(body: &[u8]) -> Result<ForwardCall, WorkerError> {
    let mut r = Reader::new(body, "data link forward");
    let op = r.u8()?;
    if op != OP_FORWARD {
        return Err(WorkerError::InvalidArgument(format!(
            "data link: unknown request {op}"
        )));
    }
    let n = r.count(8)?;
    let mut tokens = Vec::with_capacity(n);
    for _ in 0..n {
        tokens.push(TokenPos {
            seq: r.u32()?,
            pos: r.u32()?,
        });
    }
    let input = match r.u8()? {
        IN_IDS => ForwardInput::TokenIds(r.u32s()?),
        IN_HIDDEN => ForwardInput::Hidden(r.f32s()?),
        IN_LENT => ForwardInput::Lent(r.area()?),
        other => {
            return Err(WorkerError::InvalidArgument(format!(
                "data link forward: unknown input kind {other}"
            )));
        }
    };
    let logits_rows = r.u32s()?;
    let (mode, k) = (r.u8()?, r.u32()?);
    let rows = match mode {
        ROWS_LOGITS => Rows::Logits,
        ROWS_ARGMAX => Rows::ArgMax,
        ROWS_TOP => Rows::Top(k),
        ROWS_LOGPROBS => Rows::LogProbs(k),
        ROWS_EMBEDDINGS => Rows::Embeddings,
        ROWS_HANDOFF => Rows::HandOff(k),
        other => {
            return Err(WorkerError::InvalidArgument(format!(
                "data link forward: unknown rows kind {other}"
            )));
        }
    };
    let targets = r.u32s()?;
    r.end()?;
    Ok(ForwardCall {
        tokens,
        input,
        logits_rows,
        rows,
        targets,
    })
}

pub fn encode_output(result: &Result<ForwardOutput, WorkerError>) -> Vec<u8> {
    let values = match result {
        Ok(ForwardOutput::Hidden(v) | ForwardOutput::Logits(v) | ForwardOutput::Embeddings(v)) => {
            v.len()
        }
        Ok(ForwardOutput::ArgMax(ids)) => ids.len(),
        Ok(ForwardOutput::Top { counts, candidates }) => counts.len() + 2 * candidates.len(),
        Ok(ForwardOutput::Scored {
            counts,
            candidates,
            scores,
        }) => counts.len() + 2 * candidates.len() + 2 * scores.len(),
        Ok(ForwardOutput::Lent(_)) | Err(_) => 0,
    };
    let mut w = Writer::with_room(4 * values);
    match result {
        Ok(ForwardOutput::Hidden(h)) => w.u8(Code::Ok as u8).u8(OUT_HIDDEN).f32s(h),
        Ok(ForwardOutput::Logits(l)) => w.u8(Code::Ok as u8).u8(OUT_LOGITS).f32s(l),
        Ok(ForwardOutput::Embeddings(e)) => w.u8(Code::Ok as u8).u8(OUT_EMBEDDINGS).f32s(e),
        Ok(ForwardOutput::ArgMax(ids)) => w.u8(Code::Ok as u8).u8(OUT_ARGMAX).u32s(ids),
        Ok(ForwardOutput::Top { counts, candidates }) => {
            w.u8(Code::Ok as u8).u8(OUT_TOP);
            write_candidates(&mut w, counts, candidates)
        }
        Ok(ForwardOutput::Scored {
            counts,
            candidates,
            scores,
        }) => {
            w.u8(Code::Ok as u8).u8(OUT_SCORED);
            write_candidates(&mut w, counts, candidates);
            w.len_of(scores.len());
            for (lse, target) in scores {
                w.u32(lse.to_bits()).u32(target.to_bits());
            }
            &mut w
        }
        Ok(ForwardOutput::Lent(a)) => w.u8(Code::Ok as u8).u8(OUT_LENT).area(a),
        Err(e) => w.u8(code_of(e) as u8).bytes(e.to_string().as_bytes()),
    };
    w.finish()
}

pub fn decode_output(body: &[u8]) -> Result<Result<ForwardOutput, Refusal>, WorkerError> {
    let mut r = match status(body, "data link reply")? {
        Ok(r) => r,
        Err(refusal) => return Ok(Err(refusal)),
    };
    let out = match r.u8()? {
        OUT_HIDDEN => ForwardOutput::Hidden(r.f32s()?),
        OUT_LOGITS => ForwardOutput::Logits(r.f32s()?),
        OUT_EMBEDDINGS => ForwardOutput::Embeddings(r.f32s()?),
        OUT_ARGMAX => ForwardOutput::ArgMax(r.u32s()?),
        OUT_LENT => ForwardOutput::Lent(r.area()?),
        OUT_TOP => {
            let counts = r.u32s()?;
            let candidates = read_pairs(&mut r, |id, bits| (id, f32::from_bits(bits)))?;
            ForwardOutput::Top { counts, candidates }
        }
        OUT_SCORED => {
            let counts = r.u32s()?;
            let candidates = read_pairs(&mut r, |id, bits| (id, f32::from_bits(bits)))?;
            let scores = read_pairs(&mut r, |a, b| (f32::from_bits(a), f32::from_bits(b)))?;
            ForwardOutput::Scored {
                counts,
                candidates,
                scores,
            }
        }
        other => {
            return Err(WorkerError::InvalidArgument(format!(
                "data link reply: unknown output kind {other}"
            )));
        }
    };
    r.end()?;
    Ok(Ok(out))
}

/// Candidate counts, then the candidates as (id, logit bits) pairs.
fn write_candidates<'w>(
    w: &'w mut Writer,
    counts: &[u32],
    candidates: &[(u32, f32)],
) -> &'w mut Writer {
    w.u32s(counts);
    w.len_of(candidates.len());
    for (id, logit) in candidates {
        w.u32(*id).u32(logit.to_bits());
    }
    w
}

/// A counted list of pairs of 32-bit words.
fn read_pairs<T>(r: &mut Reader<'_>, pair: impl Fn(u32, u32) -> T) -> Result<Vec<T>, WorkerError> {
    let n = r.count(8)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(pair(r.u32()?, r.u32()?));
    }
    Ok(out)
}
