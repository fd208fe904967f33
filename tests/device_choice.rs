//! `--device` on a machine without a CUDA GPU (CI): `auto` (the default) runs on the cpu,
//! and naming a GPU exits non-zero with a message, never a panic.

mod support;

use std::process::Command;
use support::{TETHER, TinyModel};

fn tether(args: &[&str]) -> (bool, String) {
    let out = Command::new(TETHER)
        .args(args)
        .output()
        .expect("run tether");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn without_a_gpu_auto_uses_the_cpu_and_cuda_is_a_clear_error() {
    if tether_compute::cuda::device_count() > 0 {
        // On a GPU machine `auto` picks the GPU; the GPU scripts cover that path.
        return;
    }
    let model = TinyModel::new();
    let run = ["run", "--model", model.arg(), "--prompt", "hi", "-n", "3"];
    let (ok, text) = tether(&run);
    assert!(ok, "run with the default device failed:\n{text}");

    for device in ["cuda", "cuda:0", "cuda:3"] {
        let mut args = run.to_vec();
        args.extend(["--device", device]);
        let (ok, text) = tether(&args);
        assert!(
            !ok,
            "run --device {device} succeeded without a GPU:\n{text}"
        );
        assert!(
            !text.contains("panicked"),
            "run --device {device} panicked:\n{text}"
        );
        assert!(
            text.contains("CUDA") || text.contains("libcuda"),
            "run --device {device}: no word of CUDA in:\n{text}"
        );
    }
    let bench = [
        "bench",
        "--model",
        model.arg(),
        "-p",
        "4",
        "-n",
        "2",
        "-r",
        "1",
    ];
    let (ok, text) = tether(&[&bench[..], &["--device", "cuda:0"]].concat());
    assert!(
        !ok && !text.contains("panicked"),
        "bench --device cuda:0:\n{text}"
    );
    let (ok, text) = tether(&[&bench[..], &["--device", "gpu"]].concat());
    assert!(
        !ok && text.contains("unknown device"),
        "bench --device gpu:\n{text}"
    );
}
