//! The deploy/ files must not rot: every YAML and JSON file parses, and every `tether` or
//! `tetherctl` subcommand and flag they use exists (checked against the real binaries'
//! `--help`).

use std::path::{Path, PathBuf};
use std::process::Command;
use yaml_rust2::{Yaml, YamlLoader};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

fn files_with(ext: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![deploy_dir()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("deploy dir readable") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| ext.contains(&e))
            {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// Every string array found anywhere in a YAML document (command/args lists).
fn string_lists(doc: &Yaml, out: &mut Vec<Vec<String>>) {
    match doc {
        Yaml::Array(items) => {
            let strings: Vec<String> = items
                .iter()
                .filter_map(|i| i.as_str().map(str::to_string))
                .collect();
            if !strings.is_empty() && strings.len() == items.len() {
                out.push(strings);
            }
            items.iter().for_each(|i| string_lists(i, out));
        }
        Yaml::Hash(map) => map.values().for_each(|v| string_lists(v, out)),
        _ => {}
    }
}

/// A command line of ours: the binary, its subcommand (if any) and the flags used.
#[derive(Debug)]
struct Use {
    binary: &'static str,
    subcommand: Option<String>,
    flags: Vec<String>,
    origin: String,
}

const SUBCOMMANDS: [&str; 8] = [
    "serve", "worker", "run", "plan", "bench", "gguf", "attach", "eval",
];

fn classify(words: &[String], origin: &str) -> Option<Use> {
    let first = words.first()?;
    let (binary, rest) = if first.ends_with("tetherctl") {
        ("tetherctl", &words[1..])
    } else if first.ends_with("tether") {
        ("tether", &words[1..])
    } else if SUBCOMMANDS.contains(&first.as_str()) {
        // Container args: the image's entrypoint is `tether`.
        ("tether", words)
    } else {
        return None;
    };
    let subcommand = match binary {
        "tether" => rest.first().cloned(),
        _ => rest.iter().find(|w| !w.starts_with('-')).and_then(|w| {
            // tetherctl's first positional after its flag values is the command.
            ["status", "sessions", "kill", "drain"]
                .contains(&w.as_str())
                .then(|| w.clone())
        }),
    };
    let flags = rest
        .iter()
        .filter(|w| w.starts_with("--"))
        .map(|w| w.split('=').next().unwrap_or(w).to_string())
        .collect();
    Some(Use {
        binary,
        subcommand,
        flags,
        origin: origin.to_string(),
    })
}

fn uses() -> Vec<Use> {
    let mut found = Vec::new();
    for path in files_with(&["yaml", "yml"]) {
        let text = std::fs::read_to_string(&path).expect("read yaml");
        let docs = YamlLoader::load_from_str(&text)
            .unwrap_or_else(|e| panic!("{} does not parse as YAML: {e}", path.display()));
        let mut lists = Vec::new();
        docs.iter().for_each(|d| string_lists(d, &mut lists));
        for list in lists {
            found.extend(classify(&list, &path.display().to_string()));
        }
    }
    for path in files_with(&["service"]) {
        let text = std::fs::read_to_string(&path).expect("read unit");
        for line in text.lines().filter(|l| l.starts_with("ExecStart=")) {
            let words: Vec<String> = line
                .split(|c: char| c.is_whitespace() || c == '\'' || c == '"')
                .skip_while(|w| !w.ends_with("/tether") && !w.ends_with("/tetherctl"))
                .filter(|w| !w.is_empty())
                .map(str::to_string)
                .collect();
            found.extend(classify(&words, &path.display().to_string()));
        }
    }
    found
}

fn help(binary: &str, subcommand: Option<&str>) -> String {
    let exe = match binary {
        "tether" => env!("CARGO_BIN_EXE_tether"),
        _ => env!("CARGO_BIN_EXE_tetherctl"),
    };
    let mut cmd = Command::new(exe);
    if binary == "tetherctl" {
        // tetherctl needs --worker to parse; help does not contact it.
        cmd.args(["--worker", "127.0.0.1:1"]);
    }
    cmd.args(subcommand).arg("--help");
    let out = cmd.output().expect("run --help");
    assert!(
        out.status.success(),
        "{binary} {subcommand:?} --help failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn every_yaml_and_json_file_parses() {
    let yaml = files_with(&["yaml", "yml"]);
    assert!(
        yaml.len() >= 3,
        "expected compose and k8s files, got {yaml:?}"
    );
    for path in files_with(&["json"]) {
        let text = std::fs::read_to_string(&path).expect("read json");
        serde_json::from_str::<serde_json::Value>(&text)
            .unwrap_or_else(|e| panic!("{} does not parse as JSON: {e}", path.display()));
    }
    // uses() parses every YAML file and panics on the first that does not parse.
    assert!(!uses().is_empty());
}

#[test]
fn every_subcommand_and_flag_in_deploy_files_exists() {
    let uses = uses();
    for needed in ["serve", "worker"] {
        assert!(
            uses.iter().any(|u| u.subcommand.as_deref() == Some(needed)),
            "no deploy file runs `tether {needed}`"
        );
    }
    for u in &uses {
        let text = help(u.binary, u.subcommand.as_deref());
        for flag in &u.flags {
            assert!(
                text.contains(&format!("{flag} ")) || text.contains(&format!("{flag}\n")),
                "{}: `{} {}` has no flag {flag}",
                u.origin,
                u.binary,
                u.subcommand.as_deref().unwrap_or("")
            );
        }
    }
}

/// What can be checked of the image without a docker daemon: every binary the Dockerfile
/// builds, copies or runs is one this workspace defines, and each built one is copied.
#[test]
fn the_dockerfile_builds_copies_and_runs_real_binaries() {
    let text = std::fs::read_to_string(deploy_dir().join("docker/Dockerfile"))
        .expect("deploy/docker/Dockerfile readable");
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .expect("tether-cli Cargo.toml readable");
    let defined: Vec<&str> = manifest
        .split("[[bin]]")
        .skip(1)
        .filter_map(|b| b.lines().find_map(|l| l.trim().strip_prefix("name = ")))
        .map(|n| n.trim_matches('"'))
        .collect();
    assert!(
        defined.contains(&"tether") && defined.contains(&"tetherctl"),
        "{defined:?}"
    );
    let words: Vec<&str> = text.split_whitespace().collect();
    let built: Vec<&str> = words
        .windows(2)
        .filter(|w| w[0] == "--bin")
        .map(|w| w[1])
        .collect();
    assert!(!built.is_empty(), "the Dockerfile builds no --bin");
    for b in &built {
        assert!(defined.contains(b), "Dockerfile builds unknown binary {b}");
        let copied = format!("/src/target/release/{b}");
        assert!(
            text.contains(&copied),
            "Dockerfile builds {b} but never copies {copied}"
        );
    }
    let entry = text
        .lines()
        .find_map(|l| l.strip_prefix("ENTRYPOINT"))
        .expect("an ENTRYPOINT");
    let first = entry
        .trim()
        .trim_matches(|c| c == '[' || c == ']')
        .split(',')
        .next()
        .map(|s| s.trim().trim_matches('"'))
        .unwrap_or_default();
    assert!(
        built.contains(&first),
        "ENTRYPOINT runs {first}, which is not built"
    );
    assert!(
        text.contains("STOPSIGNAL SIGTERM"),
        "workers drain on SIGTERM"
    );
}
