//! The pre-tokenizer's splits, on the `regex` crate's automata where the pattern allows
//! (the lookahead applied afterwards), on `fancy-regex` otherwise.

/// The usual pre-tokenizer patterns (GPT-2's, Llama 3's, Qwen's, tiktoken's) end in
/// `\s+(?!\S)|\s+`: a whitespace run before a word leaves its last character to the word.
/// The lookahead makes `fancy-regex` run its backtracking VM over the whole text, most of
/// this path's time, so such a pattern runs on the `regex` crate's automata without it,
/// and the lookahead is applied afterwards: a whitespace run of two or more characters
/// that the last alternative matched, followed by more text, gives up its last character.
pub(super) enum Splitter {
    /// Any other pattern, as `tokenizers` runs it.
    Fancy(fancy_regex::Regex),
    Plain {
        /// The pattern with `\s+` for its last two alternatives.
        re: regex::Regex,
        /// The alternatives before them: a whitespace run one of these matched is kept.
        earlier: Option<regex::Regex>,
    },
}

/// How the usual patterns end.
pub(super) const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";

impl Splitter {
    pub(super) fn new(pattern: &str) -> Result<Splitter, String> {
        let plain = pattern.strip_suffix(LOOKAHEAD_TAIL).and_then(|head| {
            let re = regex::Regex::new(&format!("{head}|\\s+")).ok()?;
            let earlier = if head.is_empty() {
                None
            } else {
                Some(regex::Regex::new(head).ok()?)
            };
            Some(Splitter::Plain { re, earlier })
        });
        match plain {
            Some(p) => Ok(p),
            None => fancy_regex::Regex::new(pattern)
                .map(Splitter::Fancy)
                .map_err(|e| format!("pattern {pattern:?}: {e}")),
        }
    }

    /// Calls `piece` with each match of `text` and each stretch between matches, in order.
    pub(super) fn split(
        &self,
        text: &str,
        mut piece: impl FnMut(&str) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut prev = 0;
        let mut pos = 0;
        while pos <= text.len() {
            let (start, end) = match self {
                Splitter::Fancy(re) => match re.find_from_pos(text, pos) {
                    Ok(Some(m)) => (m.start(), m.end()),
                    Ok(None) => break,
                    Err(e) => return Err(e.to_string()),
                },
                Splitter::Plain { re, earlier } => {
                    let Some(m) = re.find_at(text, pos) else {
                        break;
                    };
                    let (start, mut end) = (m.start(), m.end());
                    let run = m.as_str();
                    if end < text.len()
                        && run.chars().all(char::is_whitespace)
                        && run.chars().nth(1).is_some()
                        && earlier.as_ref().is_none_or(|e| {
                            e.find_at(text, start).is_none_or(|e| e.start() != start)
                        })
                    {
                        end = start + run.char_indices().last().map_or(0, |(i, _)| i);
                    }
                    (start, end)
                }
            };
            if prev < start {
                piece(&text[prev..start])?;
            }
            if start < end {
                piece(&text[start..end])?;
                pos = end;
            } else {
                // An empty match: move on a character.
                pos = end + text[end..].chars().next().map_or(1, char::len_utf8);
            }
            prev = end;
        }
        if prev < text.len() {
            piece(&text[prev..])?;
        }
        Ok(())
    }
}
