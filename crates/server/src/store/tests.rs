//! Unit tests: exact responses, revisions and events for each of etcd's rules.
