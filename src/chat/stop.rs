//! The stop set: the token ids that end a generated turn, and stop strings.
//!
//! Ids come from the `.mlt` (tokenizer EOS, generation_config.json's `eos_token_id`,
//! the template's end-of-turn token, `mlt-convert --stop-token`); strings are the
//! caller's (a sampler option, an API request's `stop`). A generation loop checks each
//! new id with [`StopSet::is_stop`] and, when strings are set, the text so far with
//! [`StopSet::find_string`]; [`StopSet::held_back`] says how much of the text's end to
//! keep from a stream because it may still become a stop string.

use crate::format::mlt::Mlt;
use crate::format::mlt_chat::{source_names, StopToken, STOP_EOS};

/// Token ids and strings that end generation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopSet {
    /// Strictly increasing ids, each with its `STOP_*` source bits.
    tokens: Vec<StopToken>,
    /// Stop strings, none empty.
    strings: Vec<String>,
}

impl StopSet {
    /// The file's stop set: its chat section's, or else its EOS alone (a tokenizer
    /// without either has an empty set: generation then ends only at the length limit).
    pub fn from_mlt(m: &Mlt) -> StopSet {
        let tokens = match (&m.chat, m.eos) {
            (Some(c), _) => c.stop.clone(),
            (None, Some(eos)) => vec![StopToken {
                id: eos,
                sources: STOP_EOS,
            }],
            (None, None) => Vec::new(),
        };
        StopSet {
            tokens,
            strings: Vec::new(),
        }
    }

    /// A set of the given ids (source: given) and strings.
    pub fn new(ids: &[u32], strings: &[&str]) -> StopSet {
        let mut s = StopSet::default();
        for &id in ids {
            s.add_id(id, crate::format::mlt_chat::STOP_GIVEN);
        }
        for t in strings {
            s.add_string(t);
        }
        s
    }

    /// Adds an id (its sources are merged if it is already there).
    pub fn add_id(&mut self, id: u32, sources: u32) {
        match self.tokens.binary_search_by_key(&id, |t| t.id) {
            Ok(i) => self.tokens[i].sources |= sources,
            Err(i) => self.tokens.insert(i, StopToken { id, sources }),
        }
    }

    /// Adds a stop string; empty strings are ignored (they would stop at once).
    pub fn add_string(&mut self, s: &str) {
        if !s.is_empty() && !self.strings.iter().any(|x| x == s) {
            self.strings.push(s.to_string());
        }
    }

    /// Whether generating `id` ends the turn.
    pub fn is_stop(&self, id: u32) -> bool {
        self.tokens.binary_search_by_key(&id, |t| t.id).is_ok()
    }

    /// The ids, in increasing order.
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.tokens.iter().map(|t| t.id)
    }

    /// The ids with their source bits.
    pub fn tokens(&self) -> &[StopToken] {
        &self.tokens
    }

    /// The names of the sources of `id` (empty if it is not a stop id).
    pub fn sources(&self, id: u32) -> Vec<&'static str> {
        self.tokens
            .iter()
            .find(|t| t.id == id)
            .map(|t| source_names(t.sources))
            .unwrap_or_default()
    }

    pub fn strings(&self) -> &[String] {
        &self.strings
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty() && self.strings.is_empty()
    }

    /// The byte offset of the earliest stop string in `text`, if one occurs: the
    /// output ends there.
    pub fn find_string(&self, text: &str) -> Option<usize> {
        self.strings.iter().filter_map(|s| text.find(s)).min()
    }

    /// How many bytes at the end of `text` could be the start of a stop string (a
    /// stream holds them back until they are decided). Always a char boundary.
    pub fn held_back(&self, text: &str) -> usize {
        let mut keep = 0;
        for s in &self.strings {
            // The longest proper prefix of `s` that `text` ends with.
            for (i, _) in s.char_indices().skip(1) {
                if i > keep && text.ends_with(&s[..i]) {
                    keep = i;
                }
            }
        }
        keep
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::mlt_chat::{STOP_END_OF_TURN, STOP_GIVEN};

    #[test]
    fn ids_and_sources() {
        let mut s = StopSet::default();
        s.add_id(7, STOP_END_OF_TURN);
        s.add_id(2, STOP_EOS);
        s.add_id(7, STOP_EOS);
        assert_eq!(s.ids().collect::<Vec<_>>(), vec![2, 7]);
        assert!(s.is_stop(7) && s.is_stop(2) && !s.is_stop(3));
        assert_eq!(s.sources(7), vec!["eos", "end_of_turn"]);
        assert!(s.sources(3).is_empty());
        let g = StopSet::new(&[5], &["\n\n"]);
        assert_eq!(g.sources(5), vec!["given"]);
        assert_eq!(g.tokens()[0].sources, STOP_GIVEN);
    }

    #[test]
    fn strings() {
        let s = StopSet::new(&[], &["</s>", "User:", ""]);
        assert_eq!(s.strings().len(), 2);
        assert_eq!(s.find_string("hello User: x </s>"), Some(6));
        assert_eq!(s.find_string("hello"), None);
        assert_eq!(s.held_back("hello </"), 2);
        assert_eq!(s.held_back("hello Use"), 3);
        assert_eq!(s.held_back("hello"), 0);
        // Held-back lengths fall on char boundaries.
        let u = StopSet::new(&[], &["é!"]);
        assert_eq!(u.held_back("caf\u{e9}"), 2);
    }
}
