//! Interned names: a [`Name`] is a pointer to one process-wide copy of a text, so it is an
//! 8-byte `Copy` value compared and hashed by pointer, carried without allocating or touching
//! a shared reference count.
//!
//! The state-store coordinator builds its ids of them (module
//! `coordinators::state_store::ids`: tens of millions of reports a second through one
//! endpoint), and the bus names endpoints with them, so that every [`Reply`](crate::Reply)
//! can name its endpoint in a timeout error for the cost of one word.
//!
//! Interned text is never freed: this is bounded by the distinct texts a process sees (store
//! ids' parts, endpoint names), and [`Name::interned_count`] exposes the count for monitoring.

use std::{
    cmp::Ordering,
    fmt,
    hash::{Hash, Hasher},
    sync::{OnceLock, RwLock},
};

use rustc_hash::FxHashMap;

/// Interner shards: concurrent interning of different strings rarely meets on one lock.
const NAME_SHARDS: usize = 16;

/// The text behind a [`Name`]; leaked, so it lives as long as the process.
struct NameData {
    text: Box<str>,
}

/// An interned string: equal texts give the same pointer, so equality and hashing look at the
/// pointer only. `Copy`, 8 bytes. Ordering and display use the text.
///
/// ```
/// use coordbus::coordinators::state_store::Name;
/// let a = Name::new("/checkpoints/q1");
/// let b = Name::new(&String::from("/checkpoints/q1"));
/// assert_eq!(a, b);
/// assert_eq!(a.as_str(), "/checkpoints/q1");
/// ```
#[derive(Clone, Copy)]
pub struct Name(&'static NameData);

type NameShard = RwLock<FxHashMap<&'static str, Name>>;

fn name_shards() -> &'static [NameShard; NAME_SHARDS] {
    static SHARDS: OnceLock<[NameShard; NAME_SHARDS]> = OnceLock::new();
    SHARDS.get_or_init(|| std::array::from_fn(|_| RwLock::new(FxHashMap::default())))
}

impl Name {
    /// Interns `text` (a lookup, and one leaked allocation the first time a text is seen).
    pub fn new(text: &str) -> Self {
        let mut hasher = rustc_hash::FxHasher::default();
        text.hash(&mut hasher);
        let shard = &name_shards()[(hasher.finish() as usize) % NAME_SHARDS];
        // A poisoned lock only means another thread panicked while holding it; the map is
        // still consistent (inserts are single calls), so keep using it.
        if let Some(name) =
            shard.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(text)
        {
            return *name;
        }
        let mut names = shard.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(name) = names.get(text) {
            return *name;
        }
        let data: &'static NameData = Box::leak(Box::new(NameData { text: text.into() }));
        let name = Name(data);
        names.insert(&data.text, name);
        name
    }

    /// The text.
    pub fn as_str(self) -> &'static str {
        &self.0.text
    }

    /// Whether the text is empty.
    pub fn is_empty(self) -> bool {
        self.0.text.is_empty()
    }

    /// How many distinct texts this process has interned so far.
    pub fn interned_count() -> usize {
        name_shards()
            .iter()
            .map(|shard| shard.read().unwrap_or_else(std::sync::PoisonError::into_inner).len())
            .sum()
    }
}

impl PartialEq for Name {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for Name {}

impl Hash for Name {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_usize(std::ptr::from_ref(self.0) as usize);
    }
}

impl PartialOrd for Name {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Name {
    fn cmp(&self, other: &Self) -> Ordering {
        if self == other {
            Ordering::Equal
        } else {
            self.as_str().cmp(other.as_str())
        }
    }
}

impl fmt::Display for Name {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.as_str())
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), formatter)
    }
}

impl From<&str> for Name {
    fn from(text: &str) -> Self {
        Self::new(text)
    }
}

impl From<String> for Name {
    fn from(text: String) -> Self {
        Self::new(&text)
    }
}

impl From<&String> for Name {
    fn from(text: &String) -> Self {
        Self::new(text)
    }
}

impl Default for Name {
    /// The empty name.
    fn default() -> Self {
        Self::new("")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_interned_once_and_compare_by_text_order() {
        let a = Name::new("interned-test-a");
        let a_again = Name::new(&format!("interned-test-{}", "a"));
        let b = Name::new("interned-test-b");
        assert_eq!(a, a_again);
        assert!(std::ptr::eq(a.as_str(), a_again.as_str()));
        assert_ne!(a, b);
        assert!(a < b);
        assert!(Name::default().is_empty());
        assert!(Name::interned_count() >= 3);
    }

    #[test]
    fn names_interned_concurrently_are_one_name() {
        let names: Vec<Name> = std::thread::scope(|scope| {
            let handles: Vec<_> =
                (0..4).map(|_| scope.spawn(|| Name::new("interned-test-race"))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(names.windows(2).all(|pair| pair[0] == pair[1]));
    }
}
