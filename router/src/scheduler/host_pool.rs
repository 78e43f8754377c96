//! The shards' host pool for preemption by swapping: which host blocks are free, which
//! hold a swapped-out request, and which a step in flight still reads.

use crate::pb;

/// Host block ids, handed out and given back by the scheduler (the shards hold the data).
#[derive(Debug)]
pub(super) struct HostPool {
    /// Free host block ids; the next one handed out is at the end.
    free: Vec<u32>,
    /// Host blocks read by this step's swap-ins: free once it has run.
    released: Vec<u32>,
}

impl HostPool {
    pub(super) fn new(num_blocks: u32) -> Self {
        Self {
            free: (0..num_blocks).rev().collect(),
            released: Vec::new(),
        }
    }

    /// Host blocks not holding a swapped-out request.
    pub(super) fn num_unused(&self) -> usize {
        self.free.len() + self.released.len()
    }

    /// Copies device blocks `table` out to free host blocks (`copies`), returning the host
    /// blocks in table order; None, copying nothing, when too few are free.
    pub(super) fn swap_out(
        &mut self,
        table: &[u32],
        copies: &mut Vec<pb::BlockCopy>,
    ) -> Option<Vec<u32>> {
        if table.len() > self.free.len() {
            return None;
        }
        let mut swapped = Vec::with_capacity(table.len());
        for &src in table {
            let dst = self.free.pop().expect("checked above");
            copies.push(pb::BlockCopy { src, dst });
            swapped.push(dst);
        }
        Some(swapped)
    }

    /// Copies a swapped-out request's host blocks back into device blocks `table`
    /// (`copies`); the host blocks are free once the step has run.
    pub(super) fn swap_in(
        &mut self,
        swapped: &mut Vec<u32>,
        table: &[u32],
        copies: &mut Vec<pb::BlockCopy>,
    ) {
        for (&src, &dst) in swapped.iter().zip(table) {
            copies.push(pb::BlockCopy { src, dst });
        }
        self.released.append(swapped);
    }

    /// Host blocks of a request that leaves for good are free at once.
    pub(super) fn give_back(&mut self, swapped: &mut Vec<u32>) {
        self.free.append(swapped);
    }

    /// The step that read the released blocks has run: they are free.
    pub(super) fn step_ran(&mut self) {
        self.free.append(&mut self.released);
    }

    /// Every host block not held by a request (invariant checks).
    pub(super) fn unused(&self) -> impl Iterator<Item = &u32> {
        self.free.iter().chain(&self.released)
    }
}
