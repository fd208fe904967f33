//! Every fuzz target by name: the one list cargo-fuzz binaries, the corpus directories and
//! the stable replay test share.

use crate::{Finding, gguf_target, worker_targets};

/// One untrusted-input entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// A GGUF file: reader, header-only reader, inspector, hyper-parameters, tokenizer.
    Gguf,
    /// `Worker.Hello` request.
    Hello,
    /// `Worker.Attach` request stream (gRPC frames).
    Attach,
    /// `Worker.Prepare` request stream (gRPC frames): Begin with the GGUF header and
    /// stage spec, tensor chunks, End.
    Prepare,
    /// `Worker.Commit` decision.
    Commit,
    /// `Worker.Abort` decision.
    Abort,
    /// `Worker.Forward` request.
    Forward,
    /// `Worker.KvClear` request.
    KvClear,
    /// `Worker.KvTruncate` request.
    KvTruncate,
    /// `Admin.KillSession` request, then `Status` and `ListSessions`.
    Admin,
    /// A data link's frame body: a forward request on the serving session, and a hello.
    DataLink,
}

impl Target {
    /// Every target.
    pub const ALL: [Target; 11] = [
        Target::Gguf,
        Target::Hello,
        Target::Attach,
        Target::Prepare,
        Target::Commit,
        Target::Abort,
        Target::Forward,
        Target::KvClear,
        Target::KvTruncate,
        Target::Admin,
        Target::DataLink,
    ];

    /// The target's name: its cargo-fuzz binary and its corpus directory.
    pub fn name(self) -> &'static str {
        match self {
            Target::Gguf => "gguf",
            Target::Hello => "hello",
            Target::Attach => "attach",
            Target::Prepare => "prepare",
            Target::Commit => "commit",
            Target::Abort => "abort",
            Target::Forward => "forward",
            Target::KvClear => "kv_clear",
            Target::KvTruncate => "kv_truncate",
            Target::Admin => "admin",
            Target::DataLink => "data_link",
        }
    }

    /// Runs one input. `Err` is a bug: a broken invariant, a hang or a hidden panic. A
    /// panic inside is a bug too.
    pub fn run(self, data: &[u8]) -> Result<(), Finding> {
        match self {
            Target::Gguf => gguf_target::run(data),
            Target::Hello => worker_targets::hello(data),
            Target::Attach => worker_targets::attach(data),
            Target::Prepare => worker_targets::prepare(data),
            Target::Commit => worker_targets::decision(data, true),
            Target::Abort => worker_targets::decision(data, false),
            Target::Forward => worker_targets::forward(data),
            Target::KvClear => worker_targets::kv_clear(data),
            Target::KvTruncate => worker_targets::kv_truncate(data),
            Target::Admin => worker_targets::admin(data),
            Target::DataLink => worker_targets::data_link(data),
        }
    }

    /// The input for cargo-fuzz: panics on a finding so libFuzzer records the input.
    pub fn fuzz(self, data: &[u8]) {
        if let Err(finding) = self.run(data) {
            panic!("fuzz target {}: {finding}", self.name());
        }
    }
}
