//! Finished responses kept in the router's memory, for `GET /v1/responses/{id}` and for a
//! follow-up's `previous_response_id`: at most `capacity`, the least recently used
//! dropped first. Lost on restart, not shared between routers.
//!
//! The store keeps whatever a wire format stores under an id (the Responses API its
//! response and conversation) and hands it back as that type: it holds no wire type
//! itself, so the application state can own it without naming any API.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// A stored value, of the type its API put.
type Entry = Arc<dyn Any + Send + Sync>;

pub struct ResponseStore {
    capacity: usize,
    inner: Mutex<Lru>,
}

#[derive(Default)]
struct Lru {
    /// Each id's entry and the tick it was last used at.
    entries: HashMap<String, (u64, Entry)>,
    /// Ticks to ids, oldest first.
    order: BTreeMap<u64, String>,
    tick: u64,
}

impl Lru {
    fn touch(&mut self, id: &str) -> Option<Entry> {
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

    /// The response `id`, now the most recently used (None as well when it was stored
    /// as another type).
    pub fn get<T: Any + Send + Sync>(&self, id: &str) -> Option<Arc<T>> {
        self.lock().touch(id)?.downcast().ok()
    }

    pub fn put<T: Any + Send + Sync>(&self, id: String, stored: T) {
        let mut lru = self.lock();
        lru.tick += 1;
        let tick = lru.tick;
        if let Some((old, _)) = lru
            .entries
            .insert(id.clone(), (tick, Arc::new(stored) as Entry))
        {
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

    /// Stands for an API's stored response.
    struct Stored {
        response: Response,
    }

    struct Response {
        id: String,
    }

    fn stored(id: &str) -> (String, Stored) {
        let response = Response { id: id.into() };
        (id.into(), Stored { response })
    }

    fn put(store: &ResponseStore, (id, stored): (String, Stored)) {
        store.put(id, stored);
    }

    fn get(store: &ResponseStore, id: &str) -> Option<Arc<Stored>> {
        store.get(id)
    }

    fn ids(store: &ResponseStore) -> Vec<String> {
        let lru = store.lock();
        lru.order.values().cloned().collect()
    }

    #[test]
    fn the_least_recently_used_goes_first() {
        let store = ResponseStore::new(2);
        put(&store, stored("a"));
        put(&store, stored("b"));
        // Reading "a" makes "b" the oldest.
        assert_eq!(get(&store, "a").unwrap().response.id, "a");
        put(&store, stored("c"));
        assert!(get(&store, "b").is_none());
        assert!(get(&store, "a").is_some() && get(&store, "c").is_some());
        assert_eq!(ids(&store), ["a", "c"]);
        // Putting an id again replaces it, without a second entry.
        put(&store, stored("c"));
        assert_eq!(ids(&store), ["a", "c"]);
        assert_eq!(store.lock().entries.len(), 2);
        assert!(get(&store, "unknown").is_none());
    }
}
