//! Beam search's ranking, free of the scheduler: each round takes the candidates every
//! live beam's row returned (its most likely next tokens with their logprobs), keeps the
//! best `width` unfinished continuations as the next beams, and keeps the best finished
//! hypotheses under the length penalty and the early-stopping rule, exactly as
//! transformers' `generate(num_beams=...)` does (its `_beam_search`): the top
//! `candidates_per_round` continuations over all beams by cumulative logprob; those among
//! the first `width` that end (EOS, or the token limit) become hypotheses scored
//! `cumulative / generated_len ^ length_penalty`; the first `width` that do not end are
//! the next beams; the search stops when every candidate ended, when `early_stopping` is
//! true and `width` hypotheses are finished, or when no running beam can beat the worst
//! of `width` finished ones (at its current length, or with `"never"` and a positive
//! penalty at the longest it may reach).

use std::sync::Arc;

use crate::validation::BeamSearch;

/// Transformers' "minus infinity" for a hypothesis slot not filled yet.
const UNFILLED: f32 = -1.0e9;

/// One generated token of a beam, linked to the tokens before it: beams forked from one
/// another share their common history.
#[derive(Debug)]
pub(super) struct Node {
    pub token: u32,
    pub logprob: f32,
    /// The row's alternatives at this position (at most the request's `top_n_tokens`).
    pub top: Vec<(u32, f32)>,
    parent: Option<Arc<Node>>,
}

/// A beam's generated tokens, newest last in `tokens()`.
#[derive(Debug, Clone, Default)]
pub(super) struct History(Option<Arc<Node>>);

impl History {
    pub fn push(&self, token: u32, logprob: f32, top: Vec<(u32, f32)>) -> Self {
        Self(Some(Arc::new(Node {
            token,
            logprob,
            top,
            parent: self.0.clone(),
        })))
    }

    /// The nodes, oldest first.
    pub fn nodes(&self) -> Vec<&Node> {
        let mut nodes = Vec::new();
        let mut at = self.0.as_deref();
        while let Some(node) = at {
            nodes.push(node);
            at = node.parent.as_deref();
        }
        nodes.reverse();
        nodes
    }

    pub fn tokens(&self) -> Vec<u32> {
        self.nodes().iter().map(|n| n.token).collect()
    }
}

/// A live beam as the ranking sees it.
#[derive(Debug, Clone)]
pub(super) struct Beam {
    pub cumulative: f32,
    pub history: History,
}

/// What one beam's row returned this round: its candidates, most likely first.
#[derive(Debug, Clone, Default)]
pub(super) struct Candidates {
    pub tokens: Vec<(u32, f32)>,
    /// The alternatives to keep per token (`top_n_tokens`).
    pub top_n: usize,
}

/// A continuation kept as a beam of the next round.
#[derive(Debug, Clone)]
pub(super) struct Survivor {
    /// Index of the beam it continues.
    pub parent: usize,
    pub token: u32,
    pub beam: Beam,
}

/// A finished hypothesis.
#[derive(Debug, Clone)]
pub(super) struct Hypothesis {
    pub history: History,
    pub score: f32,
}

/// What a round decided.
#[derive(Debug)]
pub(super) enum Round {
    /// The next beams, best first.
    Continue(Vec<Survivor>),
    /// The search is over: the hypotheses, best first.
    Done(Vec<Hypothesis>),
}

/// One request's search state.
#[derive(Debug)]
pub(super) struct Search {
    params: BeamSearch,
    max_new_tokens: usize,
    /// Tokens every live beam has generated (they advance together).
    generated: usize,
    /// Best first, at most `width`.
    finished: Vec<Hypothesis>,
    /// Transformers' `is_early_stop_heuristic_unsatisfied` (sticky once false).
    may_improve: bool,
}

impl Search {
    pub fn new(params: BeamSearch, max_new_tokens: usize) -> Self {
        Self {
            params,
            max_new_tokens,
            generated: 0,
            finished: Vec::new(),
            may_improve: true,
        }
    }

    /// Candidates each row returns: twice the width, or more with several EOS tokens
    /// (all of a round's best continuations could end).
    pub fn candidates_per_round(width: usize, num_eos: usize) -> usize {
        (1 + num_eos).max(2) * width
    }

    /// Ranks one round. `rows[b]` holds beam `b`'s candidates; `ends(token)` says whether
    /// a token ends a hypothesis (EOS, unless ignored). `keep` = `candidates_per_round`.
    pub fn round(
        &mut self,
        beams: &[Beam],
        rows: &[Candidates],
        keep: usize,
        ends: impl Fn(u32) -> bool,
    ) -> Round {
        let width = self.params.width;
        let mut all: Vec<(f32, usize, u32, f32)> = Vec::with_capacity(beams.len() * keep);
        for (b, (beam, row)) in beams.iter().zip(rows).enumerate() {
            for &(token, logprob) in row.tokens.iter().take(keep) {
                all.push((beam.cumulative + logprob, b, token, logprob));
            }
        }
        // Stable: ties keep beam order, then the row's order (as a flat top-k would).
        all.sort_by(|a, b| b.0.total_cmp(&a.0));
        all.truncate(keep);
        let at_limit = self.generated + 1 >= self.max_new_tokens;
        let generated = self.generated + 1;
        let penalty = (generated as f64).powf(self.params.length_penalty as f64);
        let mut running = Vec::with_capacity(width);
        let mut fresh = Vec::new();
        let closed = self.params.early_stopping.is_true() && self.finished.len() == width;
        for (rank, &(cumulative, b, token, logprob)) in all.iter().enumerate() {
            let top = rows[b].tokens.iter().take(rows[b].top_n).copied().collect();
            let history = || beams[b].history.push(token, logprob, top);
            if at_limit || ends(token) {
                if rank < width && !closed && self.may_improve {
                    fresh.push(Hypothesis {
                        history: history(),
                        score: (cumulative as f64 / penalty) as f32,
                    });
                }
            } else if running.len() < width {
                running.push(Survivor {
                    parent: b,
                    token,
                    beam: Beam {
                        cumulative,
                        history: history(),
                    },
                });
            }
        }
        // Earlier hypotheses win ties, as in transformers' merge.
        self.finished.extend(fresh);
        self.finished.sort_by(|a, b| b.score.total_cmp(&a.score));
        self.finished.truncate(width);
        self.generated = generated;
        let all_ended = running.is_empty();
        if self.may_improve {
            let length =
                if self.params.early_stopping.is_never() && self.params.length_penalty > 0.0 {
                    self.max_new_tokens
                } else {
                    generated
                };
            let best = running.first().map_or(UNFILLED, |s| s.beam.cumulative);
            let best =
                (best as f64 / (length as f64).powf(self.params.length_penalty as f64)) as f32;
            let worst = if self.finished.len() == width {
                self.finished.last().map_or(UNFILLED, |h| h.score)
            } else {
                UNFILLED
            };
            self.may_improve = best > worst;
        }
        let full = self.params.early_stopping.is_true() && self.finished.len() == width;
        if all_ended || at_limit || full || !self.may_improve {
            return Round::Done(std::mem::take(&mut self.finished));
        }
        Round::Continue(running)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validation::EarlyStopping;

    const EOS: u32 = 0;

    fn search(width: usize, length_penalty: f32, early: EarlyStopping, max: usize) -> Search {
        Search::new(
            BeamSearch {
                width,
                length_penalty,
                early_stopping: early,
            },
            max,
        )
    }

    fn row(tokens: &[(u32, f32)]) -> Candidates {
        Candidates {
            tokens: tokens.to_vec(),
            top_n: 0,
        }
    }

    fn root() -> Vec<Beam> {
        vec![Beam {
            cumulative: 0.0,
            history: History::default(),
        }]
    }

    fn survivors(round: Round) -> Vec<Survivor> {
        match round {
            Round::Continue(s) => s,
            Round::Done(h) => panic!("done early with {} hypotheses", h.len()),
        }
    }

    #[test]
    fn the_best_continuations_over_all_beams_survive_whichever_beam_they_extend() {
        let mut s = search(2, 1.0, EarlyStopping::Default, 10);
        let first = survivors(s.round(
            &root(),
            &[row(&[(5, -0.1), (6, -0.2), (7, -3.0), (8, -4.0)])],
            4,
            |t| t == EOS,
        ));
        assert_eq!(first.iter().map(|s| s.token).collect::<Vec<_>>(), [5, 6]);
        let beams: Vec<Beam> = first.iter().map(|s| s.beam.clone()).collect();
        // Beam 1 (token 6) has both of the best next tokens: beam 0 is dropped.
        let rows = [
            row(&[(9, -2.0), (10, -2.5), (11, -3.0), (12, -3.5)]),
            row(&[(13, -0.1), (14, -0.2), (15, -3.0), (16, -4.0)]),
        ];
        let next = survivors(s.round(&beams, &rows, 4, |t| t == EOS));
        assert_eq!(
            next.iter().map(|s| (s.parent, s.token)).collect::<Vec<_>>(),
            [(1, 13), (1, 14)]
        );
        assert_eq!(next[0].beam.history.tokens(), [6, 13]);
        assert!((next[1].beam.cumulative - (-0.4)).abs() < 1e-6);
    }

    #[test]
    fn an_eos_among_the_first_width_candidates_finishes_a_hypothesis_with_its_length_penalty() {
        let mut s = search(2, 2.0, EarlyStopping::Default, 10);
        let first = survivors(s.round(
            &root(),
            &[row(&[(5, -0.5), (6, -0.6), (7, -3.0), (8, -4.0)])],
            4,
            |t| t == EOS,
        ));
        let beams: Vec<Beam> = first.iter().map(|s| s.beam.clone()).collect();
        let rows = [
            row(&[(EOS, -0.1), (9, -1.0), (10, -2.0), (11, -3.0)]),
            row(&[(12, -0.2), (EOS, -5.0), (13, -6.0), (14, -7.0)]),
        ];
        let next = survivors(s.round(&beams, &rows, 4, |t| t == EOS));
        // EOS ranked first: a hypothesis of 2 tokens, score -0.6 / 2^2; the beams go on
        // with the next two unfinished continuations.
        assert_eq!(next.iter().map(|s| s.token).collect::<Vec<_>>(), [12, 9]);
        assert_eq!(s.finished.len(), 1);
        assert!((s.finished[0].score - (-0.6 / 4.0)).abs() < 1e-6);
        assert_eq!(s.finished[0].history.tokens(), [5, EOS]);
    }

    #[test]
    fn an_eos_ranked_past_the_width_is_not_a_hypothesis() {
        let mut s = search(1, 1.0, EarlyStopping::Default, 10);
        let next = survivors(s.round(&root(), &[row(&[(5, -0.1), (EOS, -0.2)])], 2, |t| t == EOS));
        assert_eq!(next.len(), 1);
        assert!(s.finished.is_empty());
    }

    #[test]
    fn early_stopping_true_ends_once_width_hypotheses_are_finished() {
        let mut s = search(1, 1.0, EarlyStopping::Flag(true), 10);
        match s.round(&root(), &[row(&[(EOS, -0.1), (5, -0.2)])], 2, |t| t == EOS) {
            Round::Done(h) => assert_eq!(h[0].history.tokens(), [EOS]),
            Round::Continue(_) => panic!("went on after width hypotheses"),
        }
    }

    #[test]
    fn early_stopping_false_goes_on_while_a_running_beam_can_still_win_and_never_looks_further() {
        // Width 1, penalty 1: the EOS hypothesis scores -1.0 / 1; the running beam's -0.5
        // beats it at its current length.
        let rows = [row(&[(EOS, -1.0), (5, -0.5)])];
        let mut s = search(1, 1.0, EarlyStopping::Default, 10);
        // EOS ranks after 5 here, so it is past the width: nothing finishes.
        assert!(matches!(
            s.round(&root(), &rows, 2, |t| t == EOS),
            Round::Continue(_)
        ));
        let mut s = search(1, 1.0, EarlyStopping::Default, 10);
        let rows = [row(&[(EOS, -0.4), (5, -0.5)])];
        // The hypothesis (-0.4) beats the running beam (-0.5 / 1): done.
        assert!(matches!(
            s.round(&root(), &rows, 2, |t| t == EOS),
            Round::Done(_)
        ));
        // With "never" and a positive penalty, the running beam is judged at the longest
        // length: -0.5 / 10 > -0.4 / 1, so it goes on.
        let mut s = search(
            1,
            1.0,
            EarlyStopping::Never(crate::validation::Never::Never),
            10,
        );
        assert!(matches!(
            s.round(&root(), &rows, 2, |t| t == EOS),
            Round::Continue(_)
        ));
    }

    #[test]
    fn the_token_limit_finishes_the_best_width_candidates() {
        let mut s = search(2, 0.0, EarlyStopping::Default, 1);
        match s.round(
            &root(),
            &[row(&[(5, -0.1), (6, -0.2), (7, -0.3), (8, -0.4)])],
            4,
            |t| t == EOS,
        ) {
            Round::Done(h) => {
                let tokens: Vec<Vec<u32>> = h.iter().map(|h| h.history.tokens()).collect();
                assert_eq!(tokens, [vec![5], vec![6]]);
                assert!((h[1].score - (-0.2)).abs() < 1e-6);
            }
            Round::Continue(_) => panic!("went past the token limit"),
        }
    }
}
