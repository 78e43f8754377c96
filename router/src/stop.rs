//! Stop strings. Generation ends when the generated text contains one; the text returned
//! stops just before it. While streaming, text that might be the start of a stop string
//! is held back, so a client never sees any part of a stop string.

#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text not yet released: a suffix that could begin a stop string.
    pending: String,
    /// The stop string that ended generation (Anthropic's answers name it).
    matched: Option<String>,
}

/// What a piece of new text gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    /// Text safe to show now.
    pub text: String,
    /// A stop string matched: `text` ends just before it and generation is over.
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            pending: String::new(),
            matched: None,
        }
    }

    /// Adds newly decoded text.
    pub fn push(&mut self, text: &str) -> Release {
        if self.stops.is_empty() {
            return Release {
                text: text.to_string(),
                stopped: false,
            };
        }
        self.pending.push_str(text);
        // Earliest full match in what is held (a match always starts in held text, since
        // any text that could begin one is held).
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|&(at, _)| at);
        if let Some((at, stop)) = hit {
            self.matched = Some(stop.clone());
            self.pending.truncate(at);
            return Release {
                text: std::mem::take(&mut self.pending),
                stopped: true,
            };
        }
        let hold = self.longest_partial_match();
        let release = self.pending.len() - hold;
        let rest = self.pending.split_off(release);
        Release {
            text: std::mem::replace(&mut self.pending, rest),
            stopped: false,
        }
    }

    /// The stop string that matched, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Releases the held text (generation ended for another reason).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of a stop string.
    fn longest_partial_match(&self) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            let max = (stop.len() - 1).min(self.pending.len());
            for len in (best + 1..=max).rev() {
                if stop.is_char_boundary(len) && self.pending.ends_with(&stop[..len]) {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for p in pieces {
            let r = m.push(p);
            out.push(r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push(m.flush());
        (out, false)
    }

    #[test]
    fn a_stop_string_split_over_tokens_is_never_shown() {
        let (out, stopped) = run(&["###"], &["Hello", " #", "#", "# world"]);
        assert!(stopped);
        assert_eq!(out, vec!["Hello", " ", "", ""]);
        assert_eq!(out.concat(), "Hello ");
    }

    #[test]
    fn text_that_only_looked_like_a_stop_is_released_later() {
        let (out, stopped) = run(&["\nUser:"], &["a\n", "Us", "ually"]);
        assert!(!stopped);
        assert_eq!(out, vec!["a", "", "\nUsually", ""]);
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_the_rest_is_dropped() {
        let (out, stopped) = run(&["world", "lo"], &["hello world"]);
        assert!(stopped);
        assert_eq!(out.concat(), "hel");
        let mut m = StopMatcher::new(vec!["world".into(), "lo".into()]);
        assert_eq!(m.matched(), None);
        m.push("hello world");
        assert_eq!(m.matched(), Some("lo"));
    }

    #[test]
    fn multibyte_stop_strings_and_text_are_cut_on_character_boundaries() {
        let (out, stopped) = run(&["日本"], &["é日", "x日", "本語"]);
        assert!(stopped);
        assert_eq!(out.concat(), "é日x");
        let (out, stopped) = run(&["ab"], &["日本"]);
        assert!(!stopped);
        assert_eq!(out.concat(), "日本");
    }

    #[test]
    fn without_stops_text_passes_through() {
        let (out, stopped) = run(&[], &["a", "b"]);
        assert!(!stopped);
        assert_eq!(out, vec!["a", "b", ""]);
    }
}
