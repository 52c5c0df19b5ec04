//! Notes on stderr that never panic and never block the caller.
//!
//! `baton run` writes its notes from the thread that renews the lease. A reader that stopped
//! reading (stderr piped into a stalled process) or went away (`2>&1 | head -n1`) must not stall
//! renewals or kill the supervisor: `eprintln!` would block on a full pipe and panic on a closed
//! one. Lines go through a bounded queue to one writer thread; when the queue is full, lines are
//! dropped and counted, and write errors are ignored.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::OnceLock;
use std::time::Duration;

/// Lines waiting for the writer thread, at most.
const QUEUE: usize = 256;

enum Message {
    Line(Vec<u8>),
    Flush(SyncSender<()>),
}

static SENDER: OnceLock<SyncSender<Message>> = OnceLock::new();
static DROPPED: AtomicU64 = AtomicU64::new(0);

fn sender() -> &'static SyncSender<Message> {
    SENDER.get_or_init(|| {
        let (tx, rx) = sync_channel(QUEUE);
        // If the thread cannot be started, lines are dropped: never worth failing for.
        let _ = std::thread::Builder::new()
            .name("baton-log".into())
            .spawn(move || write_lines(rx));
        tx
    })
}

fn write_lines(rx: Receiver<Message>) {
    let mut stderr = std::io::stderr();
    for message in rx {
        match message {
            Message::Line(line) => {
                let dropped = DROPPED.swap(0, Ordering::Relaxed);
                if dropped > 0 {
                    let _ = writeln!(
                        stderr,
                        "baton: ({dropped} earlier lines dropped: stderr was not being read)"
                    );
                }
                let _ = stderr.write_all(&line);
            }
            Message::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

/// Queues `line` (a newline is added) for stderr; drops it if the queue is full.
pub fn line(text: &str) {
    let mut bytes = Vec::with_capacity(text.len() + 1);
    bytes.extend_from_slice(text.as_bytes());
    bytes.push(b'\n');
    send(bytes);
}

fn send(bytes: Vec<u8>) {
    match sender().try_send(Message::Line(bytes)) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Waits up to `limit` for queued lines to be written (before the process exits).
pub fn flush(limit: Duration) {
    let (done_tx, done_rx) = sync_channel(1);
    if sender().try_send(Message::Flush(done_tx)).is_ok() {
        let _ = done_rx.recv_timeout(limit);
    }
}

/// An `io::Write` that queues what it is given as one message when dropped (for `tracing`).
#[derive(Default)]
pub struct Writer {
    buffer: Vec<u8>,
}

impl Write for Writer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buffer.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if !self.buffer.is_empty() {
            send(std::mem::take(&mut self.buffer));
        }
    }
}
