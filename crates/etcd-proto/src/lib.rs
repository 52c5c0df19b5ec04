//! The subset of the etcd v3 gRPC API that baton speaks, generated from `proto/` at build time
//! with protox (pure Rust: no system `protoc`). Package, service, method names and field numbers
//! follow etcd's, so the messages travel to and from a real etcd unchanged.
//!
//! Both sides are generated: the clients (`etcdserverpb::kv_client::KvClient`, `lease_client`,
//! `watch_client`, `cluster_client`, `maintenance_client`), which the `baton` library's etcd
//! backend drives over its own channel, and the services (`kv_server`, …), which `baton server`
//! implements. Every message derives serde's `Serialize` and `Deserialize`: `baton server`
//! keeps requests and responses in its Raft log and snapshots.
#![allow(missing_docs, clippy::all, clippy::pedantic)]

/// Key-values and watch events (etcd's `mvccpb`).
pub mod mvccpb {
    tonic::include_proto!("mvccpb");
}

/// Requests, responses and services (etcd's `etcdserverpb`).
pub mod etcdserverpb {
    tonic::include_proto!("etcdserverpb");
}
