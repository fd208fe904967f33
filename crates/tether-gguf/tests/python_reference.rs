//! Checks every dequantizer against an independent implementation: the `gguf` Python
//! package that ships with llama.cpp (`pip install gguf numpy`). Random blocks of each type
//! go to a temporary directory, `tests/reference/dequant.py` decodes them with
//! `gguf.quants.dequantize`, and the values must match ours bit for bit.
//!
//! Skipped, with a line saying so, when the package is not installed.

use std::path::{Path, PathBuf};
use std::process::Command;

use tether_gguf::{GgmlType, dequantize};

/// Every type `dequantize` decodes that the Python package also decodes: the weight types
/// but f32, a plain copy. (gguf-py has no dequantizer for Q8_1 and Q8_K.)
fn types() -> impl Iterator<Item = GgmlType> {
    GgmlType::WEIGHTS
        .into_iter()
        .filter(|t| *t != GgmlType::F32)
}

/// Elements per type: 24 super-blocks, enough for every nibble, scale and sign to occur.
const ELEMS: usize = 24 * 256;

struct Rng(u64);
impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Offsets of the f16 scale fields inside one block of `ty`.
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4NL | GgmlType::IQ4XS => {
            &[0]
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q6K => &[208],
        _ => &[],
    }
}

/// A finite f16 (subnormals included, NaN and infinities excluded), as bits.
fn finite_f16(rng: &mut Rng) -> u16 {
    loop {
        let bits = rng.next_u64() as u16;
        if (bits >> 10) & 0x1F != 0x1F {
            return bits;
        }
    }
}

/// Random bytes of `ty`: every quant field random, every f16 scale finite, every
/// float value finite (NaN payloads would make a bit comparison meaningless).
fn random_blocks(rng: &mut Rng, ty: GgmlType) -> Vec<u8> {
    let len = ty.bytes_for(ELEMS as u64).expect("whole blocks") as usize;
    let mut bytes: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
    match ty {
        GgmlType::F16 => {
            for v in bytes.chunks_exact_mut(2) {
                v.copy_from_slice(&finite_f16(rng).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for v in bytes.chunks_exact_mut(2) {
                // Exponent all ones is inf/NaN in bf16 as in f32.
                if v[1] & 0x7F == 0x7F && v[0] & 0x80 != 0 {
                    v[1] &= 0xBF;
                }
            }
        }
        _ => {
            for block in bytes.chunks_exact_mut(ty.block_bytes()) {
                for &at in scale_offsets(ty) {
                    block[at..at + 2].copy_from_slice(&finite_f16(rng).to_le_bytes());
                }
            }
        }
    }
    bytes
}

fn python_gguf_available() -> bool {
    Command::new("python3")
        .args(["-c", "import gguf.quants, numpy"])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn scratch_dir() -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir =
        std::env::temp_dir().join(format!("tether-gguf-pyref-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn read_f32s(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn every_dequantizer_matches_the_python_gguf_package_bit_for_bit() {
    if !python_gguf_available() {
        println!("skipped: python gguf package not installed (pip install gguf numpy)");
        return;
    }
    let dir = scratch_dir();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut ours = Vec::new();
    for ty in types() {
        let bytes = random_blocks(&mut rng, ty);
        std::fs::write(dir.join(format!("{}.bin", ty.name())), &bytes).unwrap();
        let mut values = vec![0.0f32; ELEMS];
        dequantize(ty, &bytes, &mut values).unwrap();
        ours.push((ty, values));
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/dequant.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(&dir)
        .args(types().map(|t| t.name()))
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "{} failed:\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut failures = Vec::new();
    for (ty, values) in &ours {
        let reference = read_f32s(&dir.join(format!("{}.f32", ty.name())));
        assert_eq!(reference.len(), values.len(), "{ty}: element count");
        let differing: Vec<usize> = (0..values.len())
            .filter(|&i| values[i].to_bits() != reference[i].to_bits())
            .collect();
        if let Some(&i) = differing.first() {
            failures.push(format!(
                "{ty}: {} of {ELEMS} values differ; first at {i}: ours {} python {}",
                differing.len(),
                values[i],
                reference[i]
            ));
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
