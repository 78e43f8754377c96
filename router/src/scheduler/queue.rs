//! The waiting queue: requests not running, first come first served. Preempted requests
//! go back to the front so they resume before anything that arrived after them.

use std::collections::VecDeque;

use super::sequence::Sequence;
use crate::blocks::RequestId;

#[derive(Debug, Default)]
pub struct Queue {
    entries: VecDeque<Sequence>,
}

impl Queue {
    pub fn push_back(&mut self, seq: Sequence) {
        self.entries.push_back(seq);
    }

    /// Puts a preempted request back at the head of the line.
    pub fn push_front(&mut self, seq: Sequence) {
        self.entries.push_front(seq);
    }

    pub fn front(&self) -> Option<&Sequence> {
        self.entries.front()
    }

    /// The `i`-th in line (0: the front).
    pub fn get(&self, i: usize) -> Option<&Sequence> {
        self.entries.get(i)
    }

    /// Takes the `i`-th in line out (admission may pass over requests ahead of it).
    pub fn remove_at(&mut self, i: usize) -> Option<Sequence> {
        self.entries.remove(i)
    }

    pub fn pop_front(&mut self) -> Option<Sequence> {
        self.entries.pop_front()
    }

    /// Takes a request out of the line (cancellation).
    pub fn remove(&mut self, id: RequestId) -> Option<Sequence> {
        let pos = self.entries.iter().position(|s| s.id == id)?;
        self.entries.remove(pos)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Sequence> {
        self.entries.iter()
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Sequence> {
        self.entries.iter_mut()
    }

    pub fn drain(&mut self) -> impl Iterator<Item = Sequence> + '_ {
        self.entries.drain(..)
    }
}
