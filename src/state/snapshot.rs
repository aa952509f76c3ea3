//! The generic snapshot: one [`Writer`] per snapshot, which only its module holds, and any
//! number of [`Reader`]s.

use std::sync::Arc;

use tokio::sync::watch;

/// The one writer of a snapshot. It is not `Clone`: the module handed it is the only one that
/// can change the snapshot, and the compiler keeps it so. Everyone else reads through a
/// [`Reader`].
pub struct Writer<T> {
    shared: Reader<T>,
}

/// Read-only access to a snapshot. It outlives the writer: a reader whose writer has stopped
/// keeps the last value rather than an error.
pub struct Reader<T> {
    tx: Arc<watch::Sender<T>>,
}

impl<T> Clone for Reader<T> {
    fn clone(&self) -> Self {
        Reader {
            tx: self.tx.clone(),
        }
    }
}

impl<T> Writer<T> {
    pub fn new(initial: T) -> Self {
        Writer {
            shared: Reader {
                tx: Arc::new(watch::Sender::new(initial)),
            },
        }
    }

    pub fn reader(&self) -> Reader<T> {
        self.shared.clone()
    }

    /// A second writer of the same snapshot, for the device snapshot's two writing modules
    /// (`DeviceState`, `ConflictWriter`); no other module of the crate can make one.
    pub(super) fn second(&self) -> Writer<T> {
        Writer {
            shared: self.reader(),
        }
    }

    pub fn borrow(&self) -> watch::Ref<'_, T> {
        self.shared.tx.borrow()
    }

    pub fn send_modify(&self, modify: impl FnOnce(&mut T)) {
        self.shared.tx.send_modify(modify);
    }

    /// Changes the snapshot; readers are woken only if `modify` says it changed.
    pub fn send_if_modified(&self, modify: impl FnOnce(&mut T) -> bool) -> bool {
        self.shared.tx.send_if_modified(modify)
    }

    pub fn send_replace(&self, value: T) -> T {
        self.shared.tx.send_replace(value)
    }
}

impl<T: Default> Default for Writer<T> {
    fn default() -> Self {
        Writer::new(T::default())
    }
}

impl<T> Reader<T> {
    /// A receiver that has seen the current value and wakes on the next change.
    pub fn subscribe(&self) -> watch::Receiver<T> {
        self.tx.subscribe()
    }

    pub fn borrow(&self) -> watch::Ref<'_, T> {
        self.tx.borrow()
    }
}

impl<T: Clone> Reader<T> {
    pub fn current(&self) -> T {
        self.tx.borrow().clone()
    }
}
