//! Generates the tether.v1 messages, clients and servers with the vendored protoc, so a
//! build never needs a system protoc.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let proto_root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files = [
        proto_root.join("tether/v1/worker.proto"),
        proto_root.join("tether/v1/admin.proto"),
    ];
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    // Passing the path through prost's config is the same as setting PROTOC for this build,
    // without mutating the build script's environment.
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    tonic_prost_build::configure().compile_with_config(config, &files, &[proto_root])?;
    Ok(())
}
