// swift-tools-version:6.1
import PackageDescription

import struct Foundation.URL

// A path dependency's identity is its folder's name, which differs between clones.
let mainPackage = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().lastPathComponent

// Benchmarks live in their own package so that the main build never compiles the
// benchmark harness (package-benchmark) or the gRPC peer.
let package = Package(
    name: "entitlements-benchmarks",
    platforms: [.macOS(.v15)],
    dependencies: [
        .package(path: ".."),
        .package(url: "https://github.com/ordo-one/benchmark.git", from: "1.38.1", traits: ["MallocInterposer"]),
        .package(url: "https://github.com/apple/swift-nio.git", from: "2.101.2"),
        .package(url: "https://github.com/HdrHistogram/hdrhistogram-swift.git", from: "0.2.0"),
        // The gRPC peer: grpc-swift-2 over HTTP/2 (grpc-swift-nio-transport).
        .package(url: "https://github.com/grpc/grpc-swift-2.git", from: "2.4.3"),
        .package(url: "https://github.com/grpc/grpc-swift-nio-transport.git", from: "2.9.2"),
        // The load generator's gRPC client decodes the servers' headers with NIOHPACK.
        .package(url: "https://github.com/apple/swift-nio-http2.git", from: "1.46.0"),
        // TLS for the load generator's framed connections (the p2 and p3 TLS rows).
        .package(url: "https://github.com/apple/swift-nio-ssl.git", from: "2.37.6"),
        // NearCacheLoad counts the near-cache's metrics for real (an atomic per counter).
        .package(url: "https://github.com/apple/swift-metrics.git", from: "2.13.0"),
    ],
    targets: [
        // Microbenchmarks of the wire path: protobuf-c shim and frame codec.
        .executableTarget(
            name: "CodecBenchmarks",
            dependencies: [
                .product(name: "Benchmark", package: "benchmark"),
                .product(name: "EntitlementsMessages", package: mainPackage),
                .product(name: "EntitlementsWire", package: mainPackage),
                .product(name: "NIOCore", package: "swift-nio"),
            ],
            path: "Benchmarks/CodecBenchmarks",
            swiftSettings: [.swiftLanguageMode(.v6)],
            plugins: [
                .plugin(name: "BenchmarkPlugin", package: "benchmark")
            ]
        ),
        // The entitlement resolver on typical and heavy customers.
        .executableTarget(
            name: "ResolverBenchmarks",
            dependencies: [
                .product(name: "Benchmark", package: "benchmark"),
                .product(name: "EntitlementsMessages", package: mainPackage),
                .product(name: "EntitlementsResolver", package: mainPackage),
            ],
            path: "Benchmarks/ResolverBenchmarks",
            swiftSettings: [.swiftLanguageMode(.v6)],
            plugins: [
                .plugin(name: "BenchmarkPlugin", package: "benchmark")
            ]
        ),
        // The cache hit and the snapshot read-through miss, with malloc counts.
        .executableTarget(
            name: "StoreBenchmarks",
            dependencies: [
                .product(name: "Benchmark", package: "benchmark"),
                .product(name: "EntitlementsMessages", package: mainPackage),
                .product(name: "EntitlementsResolver", package: mainPackage),
                .product(name: "EntitlementsStore", package: mainPackage),
                .product(name: "EntitlementsCache", package: mainPackage),
                .product(name: "EntitlementsTools", package: mainPackage),
                .product(name: "NIOCore", package: "swift-nio"),
            ],
            path: "Benchmarks/StoreBenchmarks",
            swiftSettings: [.swiftLanguageMode(.v6)],
            plugins: [
                .plugin(name: "BenchmarkPlugin", package: "benchmark")
            ]
        ),
        // The fleet profile: writes through one server, lag to another's watch (fleet.sh).
        .executableTarget(
            name: "FleetLoad",
            dependencies: [
                .product(name: "EntitlementsClient", package: mainPackage),
                .product(name: "EntitlementsMessages", package: mainPackage),
                .product(name: "NIOPosix", package: "swift-nio"),
            ],
            path: "Sources/FleetLoad",
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        // A quick closed-loop load generator (connections x requests in flight), until the
        // full harness of the benchmarks issue exists.
        .executableTarget(
            name: "QuickLoad",
            dependencies: [
                .product(name: "EntitlementsMessages", package: mainPackage),
                .product(name: "EntitlementsWire", package: mainPackage),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
            ],
            path: "Sources/QuickLoad",
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        // The Swift client's near-cache under Zipf load, the lag of its invalidations, and
        // its stale answers with the server down (run.sh, step 9b).
        .executableTarget(
            name: "NearCacheLoad",
            dependencies: [
                "ServerHarness",
                .product(name: "EntitlementsClient", package: mainPackage),
                .product(name: "EntitlementsMessages", package: mainPackage),
                .product(name: "CoreMetrics", package: "swift-metrics"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
            ],
            path: "Sources/NearCacheLoad",
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        // What NearCacheLoad and WatchFanout share: settings, and the server they start.
        .target(
            name: "ServerHarness",
            dependencies: [.product(name: "EntitlementsClient", package: mainPackage)],
            path: "Sources/ServerHarness",
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        // Writes under watches of every customer: rate and server CPU per write as the
        // watches keep more customers.
        .executableTarget(
            name: "WatchFanout",
            dependencies: [
                "ServerHarness",
                .product(name: "EntitlementsClient", package: mainPackage),
                .product(name: "EntitlementsMessages", package: mainPackage),
            ],
            path: "Sources/WatchFanout",
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        // The least a framed server on swift-nio can do per request (README, "The NIO floor").
        .executableTarget(
            name: "NIOFloor",
            dependencies: [
                .product(name: "EntitlementsWire", package: mainPackage),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
            ],
            path: "Sources/NIOFloor",
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        // CheckEntitlements as a gRPC method, with the protobuf-c shim as its codec: shared
        // by the gRPC peer and the load generator.
        .target(
            name: "GRPCCheckService",
            dependencies: [
                .product(name: "EntitlementsMessages", package: mainPackage),
                .product(name: "GRPCCore", package: "grpc-swift-2"),
                .product(name: "NIOCore", package: "swift-nio"),
            ],
            path: "Sources/GRPCCheckService",
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        // The gRPC peer: the same resolvers and caches behind grpc-swift-2 (HTTP/2).
        .executableTarget(
            name: "GRPCPeer",
            dependencies: [
                "GRPCCheckService",
                .product(name: "EntitlementsMessages", package: mainPackage),
                .product(name: "EntitlementsServer", package: mainPackage),
                .product(name: "EntitlementsStore", package: mainPackage),
                .product(name: "EntitlementsCache", package: mainPackage),
                .product(name: "GRPCCore", package: "grpc-swift-2"),
                .product(name: "GRPCNIOTransportHTTP2Posix", package: "grpc-swift-nio-transport"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
            ],
            path: "Sources/GRPCPeer",
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        // The load generator of run.sh: closed and open loop, uniform or Zipf keys, our
        // protocol, Redis GET or gRPC (raw HTTP/2 frames), HdrHistogram percentiles, JSON
        // summaries.
        .executableTarget(
            name: "LoadGen",
            dependencies: [
                .product(name: "NIOHPACK", package: "swift-nio-http2"),
                .product(name: "EntitlementsMessages", package: mainPackage),
                .product(name: "EntitlementsWire", package: mainPackage),
                .product(name: "EntitlementsResolver", package: mainPackage),
                .product(name: "EntitlementsStore", package: mainPackage),
                .product(name: "EntitlementsCache", package: mainPackage),
                .product(name: "Histogram", package: "hdrhistogram-swift"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "NIOSSL", package: "swift-nio-ssl"),
            ],
            path: "Sources/LoadGen",
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        // Memory and cost of the store on a large snapshot: RSS under a cache budget,
        // cache hit and read-through miss cost (a plain executable; see README).
        .executableTarget(
            name: "StoreProbe",
            dependencies: [
                .product(name: "EntitlementsMessages", package: mainPackage),
                .product(name: "EntitlementsResolver", package: mainPackage),
                .product(name: "EntitlementsStore", package: mainPackage),
                .product(name: "EntitlementsCache", package: mainPackage),
                .product(name: "EntitlementsServer", package: mainPackage),
                .product(name: "NIOCore", package: "swift-nio"),
            ],
            path: "Sources/StoreProbe",
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
    ]
)
