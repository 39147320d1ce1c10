// swift-tools-version:6.0
import PackageDescription

import struct Foundation.URL

// libFuzzer targets, in their own package so that the main build never compiles with
// -sanitize=fuzzer. Build and run with `make fuzz` (see README.md here).
let mainPackage = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().lastPathComponent

let package = Package(
    name: "entitlements-fuzz",
    dependencies: [
        .package(path: ".."),
        .package(url: "https://github.com/apple/swift-nio.git", from: "2.101.2"),
    ],
    targets: [
        // Starts libFuzzer's driver (see README.md).
        .target(name: "FuzzSupport"),
        // The frame decoder on arbitrary bytes, fed in arbitrary chunks.
        .executableTarget(
            name: "FuzzFrameDecoder",
            dependencies: [
                "FuzzSupport",
                .product(name: "EntitlementsWire", package: mainPackage),
                .product(name: "NIOCore", package: "swift-nio"),
            ]
        ),
        // The protobuf-c shim decoding every request message, and re-encoding what decodes.
        .executableTarget(
            name: "FuzzMessages",
            dependencies: [
                "FuzzSupport",
                .product(name: "EntitlementsMessages", package: mainPackage),
                .product(name: "NIOCore", package: "swift-nio"),
            ]
        ),
        // The snapshot reader on an arbitrary file: open, look up, verify.
        .executableTarget(
            name: "FuzzSnapshot",
            dependencies: [
                "FuzzSupport",
                .product(name: "EntitlementsStore", package: mainPackage),
            ]
        ),
        // The write-ahead log replayer on an arbitrary file.
        .executableTarget(
            name: "FuzzLog",
            dependencies: [
                "FuzzSupport",
                .product(name: "EntitlementsStore", package: mainPackage),
            ]
        ),
    ]
)
