//! baton's own server, started inside the test process on loopback port 0: no external server
//! is needed for these tests.
// Each test binary uses a different subset.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::OnceLock;

/// A `baton server` on a thread (and tokio runtime) of its own, so that it outlives the
/// runtime of any one `#[tokio::test]`. Stopped, and its data removed, when dropped.
pub struct BackgroundServer {
    addr: SocketAddr,
    dir: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Settings beyond the defaults, kept across restarts.
    configure: fn(&mut baton_server::ServerConfig),
}

impl BackgroundServer {
    /// Starts a server on a fresh data directory and a free port.
    pub fn start() -> BackgroundServer {
        BackgroundServer::start_with(|_| {})
    }

    /// [`BackgroundServer::start`] with settings of its own.
    pub fn start_with(configure: fn(&mut baton_server::ServerConfig)) -> BackgroundServer {
        let dir = std::env::temp_dir().join(format!(
            "baton-test-server-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let mut server = BackgroundServer {
            addr: "127.0.0.1:0".parse().unwrap(),
            dir,
            stop: None,
            thread: None,
            configure,
        };
        server.spawn();
        server
    }

    /// Where clients connect.
    pub fn endpoint(&self) -> String {
        self.addr.to_string()
    }

    /// Its data directory.
    pub fn data_dir(&self) -> &std::path::Path {
        &self.dir
    }

    fn spawn(&mut self) {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let mut config = baton_server::ServerConfig::new(self.addr, &self.dir);
        (self.configure)(&mut config);
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let server = match baton_server::start(config).await {
                    Ok(server) => server,
                    Err(error) => {
                        ready_tx.send(Err(error.to_string())).unwrap();
                        return;
                    }
                };
                ready_tx.send(Ok(server.addr())).unwrap();
                let _ = stop_rx.await;
                server.shutdown().await.unwrap();
            });
        });
        let addr = ready_rx
            .recv()
            .expect("the server thread ended")
            .unwrap_or_else(|e| panic!("baton server did not start: {e}"));
        self.addr = addr;
        self.stop = Some(stop_tx);
        self.thread = Some(thread);
    }

    /// Stops the server (as a clean shutdown), keeping its data.
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }

    /// Stops and starts the server again on the same port and data directory.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Replaces the server by a fresh one with an empty data directory on the same port: its
    /// revisions start again from 1 (a wiped or restored-from-old-backup server).
    pub fn wipe(&mut self) {
        self.stop();
        std::fs::remove_dir_all(&self.dir).unwrap();
        self.spawn();
    }
}

impl Drop for BackgroundServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The server shared by every test of a binary (started on first use, never stopped: the
/// process ends it, and its data directory goes at the process's exit).
pub fn shared() -> &'static str {
    static SHARED: OnceLock<(String, &'static BackgroundServer)> = OnceLock::new();
    &SHARED
        .get_or_init(|| {
            let server: &'static BackgroundServer = Box::leak(Box::new(BackgroundServer::start()));
            let _ = SHARED_DIR.set(server.dir.clone());
            // SAFETY: registers a plain function without arguments to run at exit.
            unsafe { libc::atexit(remove_shared_dir) };
            (server.endpoint(), server)
        })
        .0
}

static SHARED_DIR: OnceLock<PathBuf> = OnceLock::new();

extern "C" fn remove_shared_dir() {
    if let Some(dir) = SHARED_DIR.get() {
        let _ = std::fs::remove_dir_all(dir);
    }
}
