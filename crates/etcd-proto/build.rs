//! Compiles the etcd v3 API subset in `proto/` with protox (pure Rust: no system protoc needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/kv.proto", "proto/rpc.proto"];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // No `connect` constructors: they need tonic's transport, which the users of the
        // clients bring themselves (a channel of their own).
        .build_transport(false)
        // Requests and responses travel in baton server's Raft log and snapshots, encoded with
        // serde.
        .type_attribute(".", "#[derive(serde::Serialize, serde::Deserialize)]")
        .compile_fds(descriptors)?;
    Ok(())
}
