//! A small seeded mutator for the stable fuzz loop: the byte-level edits libFuzzer makes
//! most often, plus the values that break length fields (0, all ones, powers of two) written
//! both as little-endian integers (GGUF) and as protobuf varints (prost length prefixes).

/// splitmix64: tiny, seedable, good enough to pick edits; runs replay from the seed alone.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A value in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
}

/// Values that make length and count fields lie.
const INTERESTING: [u64; 16] = [
    0,
    1,
    2,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    i64::MAX as u64,
    u64::MAX,
];

/// A protobuf varint of `v`.
fn varint(mut v: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(10);
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return out;
        }
        out.push(byte | 0x80);
    }
}

/// Writes `bytes` over `out` at `at`, growing `out` where they run past its end.
fn overwrite(out: &mut Vec<u8>, at: usize, bytes: &[u8]) {
    let end = at + bytes.len();
    if end > out.len() {
        out.resize(end, 0);
    }
    out[at..end].copy_from_slice(bytes);
}

/// One to four random edits of `input`; `others` (the rest of the target's corpus) feeds
/// splices. The result stays under `max_len` bytes.
pub fn mutate(input: &[u8], others: &[Vec<u8>], rng: &mut Rng, max_len: usize) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let len = out.len();
        let at = rng.below(len + 1);
        match rng.below(10) {
            0 if len > 0 => {
                let i = rng.below(len);
                out[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                out[i] = rng.next_u64() as u8;
            }
            2 => {
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                out.splice(at..at, bytes);
            }
            3 if len > 0 => {
                let n = 1 + rng.below((len - at.min(len - 1)).min(64));
                let start = at.min(len - 1);
                out.drain(start..(start + n).min(len));
            }
            4 => {
                let v = INTERESTING[rng.below(INTERESTING.len())];
                let width = [1usize, 2, 4, 8][rng.below(4)];
                overwrite(&mut out, at, &v.to_le_bytes()[..width]);
            }
            5 => {
                let v = INTERESTING[rng.below(INTERESTING.len())];
                let bytes = varint(v);
                if rng.below(2) == 0 {
                    overwrite(&mut out, at, &bytes);
                } else {
                    out.splice(at..at, bytes);
                }
            }
            6 if !others.is_empty() => {
                let other = &others[rng.below(others.len())];
                if !other.is_empty() {
                    let from = rng.below(other.len());
                    let n = 1 + rng.below((other.len() - from).min(256));
                    out.splice(at..at, other[from..from + n].iter().copied());
                }
            }
            7 => out.truncate(at),
            8 if len > 0 => {
                let start = rng.below(len);
                let n = 1 + rng.below((len - start).min(64));
                let copy = out[start..start + n].to_vec();
                out.splice(at..at, copy);
            }
            _ => {
                // Arithmetic on one byte: nudges counts and lengths by small amounts.
                if len > 0 {
                    let i = rng.below(len);
                    let delta = 1 + rng.below(16) as u8;
                    out[i] = if rng.below(2) == 0 {
                        out[i].wrapping_add(delta)
                    } else {
                        out[i].wrapping_sub(delta)
                    };
                }
            }
        }
        out.truncate(max_len);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_mutations() {
        let input = b"GGUF\x03\0\0\0 some bytes to edit".to_vec();
        let run = |seed| {
            let mut rng = Rng::new(seed);
            (0..50)
                .map(|_| mutate(&input, std::slice::from_ref(&input), &mut rng, 1024))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn mutations_change_the_input_and_respect_the_length_cap() {
        let input = vec![0u8; 100];
        let mut rng = Rng::new(1);
        let mut changed = 0;
        for _ in 0..500 {
            let m = mutate(&input, &[], &mut rng, 120);
            assert!(m.len() <= 120);
            changed += usize::from(m != input);
        }
        assert!(
            changed > 400,
            "only {changed} of 500 mutations changed the input"
        );
    }

    #[test]
    fn varints_encode_like_protobuf() {
        assert_eq!(varint(0), [0]);
        assert_eq!(varint(300), [0xac, 0x02]);
        assert_eq!(varint(u64::MAX).len(), 10);
    }
}
