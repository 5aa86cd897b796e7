//! Throwaway etcd processes (being written).
