//! Where tether keeps its caches: compiled kernels (the cuda backend), downloaded and
//! synthesized models (the binaries). Resolved here only, so every part agrees.

use std::ffi::OsString;
use std::path::PathBuf;

/// The cache root as the process's environment sets it (see [`cache_root_from`]).
pub fn cache_root() -> Option<PathBuf> {
    cache_root_from(|name| std::env::var_os(name))
}

/// The cache root as `var` (an environment lookup) sets it: `$TETHER_CACHE`, else
/// `$XDG_CACHE_HOME/tether`, else `$HOME/.cache/tether`; `None` when none is set (an empty
/// value counts as unset).
pub fn cache_root_from(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    set("TETHER_CACHE")
        .or_else(|| set("XDG_CACHE_HOME").map(|d| d.join("tether")))
        .or_else(|| set("HOME").map(|d| d.join(".cache").join("tether")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root(vars: &[(&str, &str)]) -> Option<PathBuf> {
        cache_root_from(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| OsString::from(v))
        })
    }

    #[test]
    fn tether_cache_then_xdg_then_home() {
        let all = [
            ("TETHER_CACHE", "/t"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ];
        assert_eq!(root(&all), Some(PathBuf::from("/t")));
        assert_eq!(root(&all[1..]), Some(PathBuf::from("/x/tether")));
        assert_eq!(root(&all[2..]), Some(PathBuf::from("/h/.cache/tether")));
        assert_eq!(
            root(&[("TETHER_CACHE", ""), ("HOME", "/h")]),
            root(&all[2..])
        );
        assert_eq!(root(&[]), None);
    }
}
