//! Finished responses kept in the router's memory, for `GET /v1/responses/{id}` and for a
//! follow-up's `previous_response_id`: at most `capacity`, the least recently used
//! dropped first. Lost on restart, not shared between routers.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use super::items::Item;
use super::object::ResponseObject;

/// What a stored response holds.
#[derive(Debug)]
pub struct Stored {
    pub response: ResponseObject,
    /// The whole conversation up to and including its output, as the next turn's items
    /// (its instructions left out, as OpenAI leaves them).
    pub conversation: Vec<Item>,
}

pub struct ResponseStore {
    capacity: usize,
    inner: Mutex<Lru>,
}

#[derive(Default)]
struct Lru {
    /// Each id's entry and the tick it was last used at.
    entries: HashMap<String, (u64, Arc<Stored>)>,
    /// Ticks to ids, oldest first.
    order: BTreeMap<u64, String>,
    tick: u64,
}

impl Lru {
    fn touch(&mut self, id: &str) -> Option<Arc<Stored>> {
        let (tick, stored) = self.entries.get_mut(id)?;
        self.order.remove(tick);
        self.tick += 1;
        *tick = self.tick;
        self.order.insert(self.tick, id.to_string());
        Some(stored.clone())
    }
}

/// "A few thousand" conversations: a long one is tens of kilobytes.
const CAPACITY: usize = 4096;

impl Default for ResponseStore {
    fn default() -> Self {
        Self::new(CAPACITY)
    }
}

impl ResponseStore {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            inner: Mutex::new(Lru::default()),
        }
    }

    /// The response `id`, now the most recently used.
    pub fn get(&self, id: &str) -> Option<Arc<Stored>> {
        self.lock().touch(id)
    }

    pub fn put(&self, stored: Stored) {
        let mut lru = self.lock();
        let id = stored.response.id.clone();
        lru.tick += 1;
        let tick = lru.tick;
        if let Some((old, _)) = lru.entries.insert(id.clone(), (tick, Arc::new(stored))) {
            lru.order.remove(&old);
        }
        lru.order.insert(tick, id);
        while lru.entries.len() > self.capacity {
            let Some((_, oldest)) = lru.order.pop_first() else {
                break;
            };
            lru.entries.remove(&oldest);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lru> {
        // A panic elsewhere cannot leave the map half-changed: keep serving it.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::responses::object::tests::response;

    fn stored(id: &str) -> Stored {
        Stored {
            response: response(id),
            conversation: Vec::new(),
        }
    }

    fn ids(store: &ResponseStore) -> Vec<String> {
        let lru = store.lock();
        lru.order.values().cloned().collect()
    }

    #[test]
    fn the_least_recently_used_goes_first() {
        let store = ResponseStore::new(2);
        store.put(stored("a"));
        store.put(stored("b"));
        // Reading "a" makes "b" the oldest.
        assert_eq!(store.get("a").unwrap().response.id, "a");
        store.put(stored("c"));
        assert!(store.get("b").is_none());
        assert!(store.get("a").is_some() && store.get("c").is_some());
        assert_eq!(ids(&store), ["a", "c"]);
        // Putting an id again replaces it, without a second entry.
        store.put(stored("c"));
        assert_eq!(ids(&store), ["a", "c"]);
        assert_eq!(store.lock().entries.len(), 2);
        assert!(store.get("unknown").is_none());
    }
}
