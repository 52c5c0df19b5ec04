//! A fault-injecting TCP proxy on loopback, for network partitions between a node and etcd.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A TCP proxy that can stop forwarding in both directions. While partitioned it reads
/// nothing, so bytes wait in the kernel's buffers (as with TCP retransmitting into a dead
/// link) and arrive late, in order, when the partition heals.
pub struct Proxy {
    pub port: u16,
    partitioned: Arc<AtomicBool>,
    connections: Arc<std::sync::Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    pub fn start(upstream: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let partitioned = Arc::new(AtomicBool::new(false));
        let flag = partitioned.clone();
        let connections = Arc::new(std::sync::Mutex::new(Vec::new()));
        let open = connections.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                open.lock().unwrap().push(client.try_clone().unwrap());
                for (from, to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let flag = flag.clone();
                    std::thread::spawn(move || pump(from, to, flag));
                }
            }
        });
        Proxy {
            port,
            partitioned,
            connections,
        }
    }

    /// Closes every connection made so far (as a crashed load balancer or NAT would).
    pub fn reset(&self) {
        for connection in self.connections.lock().unwrap().drain(..) {
            let _ = connection.shutdown(Shutdown::Both);
        }
    }

    pub fn set_partitioned(&self, partitioned: bool) {
        self.partitioned.store(partitioned, Ordering::SeqCst);
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, partitioned: Arc<AtomicBool>) {
    let mut buffer = [0u8; 16 * 1024];
    loop {
        if partitioned.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        // Short read timeouts so a partition starting mid-wait takes effect promptly.
        from.set_read_timeout(Some(Duration::from_millis(5)))
            .unwrap();
        match from.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buffer[..n]).is_err() {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    let _ = to.shutdown(Shutdown::Both);
}
