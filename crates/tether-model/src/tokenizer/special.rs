//! Cutting text at special-token strings before the subword algorithm sees it (llama.cpp's
//! "parse_special" partition).

/// A piece of the input: text for the subword encoder, or a token matched literally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fragment<'t> {
    /// Ordinary text.
    Text(&'t str),
    /// A special token found in the text.
    Token(u32),
}

/// Splits `text` at every occurrence of the `specials` (id, text), which must be ordered longest
/// text first: longer tokens claim their text before shorter ones that they contain.
pub(super) fn partition<'t>(text: &'t str, specials: &[(u32, &str)]) -> Vec<Fragment<'t>> {
    let mut fragments = vec![Fragment::Text(text)];
    for &(id, special) in specials {
        if special.is_empty() {
            continue;
        }
        let mut next = Vec::with_capacity(fragments.len());
        for fragment in fragments {
            let Fragment::Text(mut rest) = fragment else {
                next.push(fragment);
                continue;
            };
            while let Some(pos) = rest.find(special) {
                if pos > 0 {
                    next.push(Fragment::Text(&rest[..pos]));
                }
                next.push(Fragment::Token(id));
                rest = &rest[pos + special.len()..];
            }
            if !rest.is_empty() {
                next.push(Fragment::Text(rest));
            }
        }
        fragments = next;
    }
    fragments
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_special_claims_its_text_first() {
        let specials = [(7, "<|im_end|>"), (5, "<|im")];
        let got = partition("a<|im_end|>b<|im", &specials);
        assert_eq!(
            got,
            [
                Fragment::Text("a"),
                Fragment::Token(7),
                Fragment::Text("b"),
                Fragment::Token(5)
            ]
        );
    }

    #[test]
    fn adjacent_specials_leave_no_empty_text() {
        let got = partition("<s><s>", &[(1, "<s>")]);
        assert_eq!(got, [Fragment::Token(1), Fragment::Token(1)]);
    }
}
