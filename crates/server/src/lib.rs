//! baton server: a coordination server speaking the subset of the etcd v3 gRPC API that
//! leases, elections and locks use, replicated and made durable by openraft.

pub mod proto {
    //! The generated etcd v3 API types and gRPC services.
    #![allow(missing_docs, clippy::all)]
    pub mod mvccpb {
        tonic::include_proto!("mvccpb");
    }
    pub mod etcdserverpb {
        tonic::include_proto!("etcdserverpb");
    }
}

pub mod store;
