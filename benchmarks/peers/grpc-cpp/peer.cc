// The gRPC C++ peer of benchmarks/run.sh: CheckEntitlements over gRPC, answered with the
// exact bytes our server sends for each customer (written by `LoadGen export-answers`), by
// a generic service on the callback API: no protobuf parsing or encoding beyond reading the
// request's user_id, the answers held as slices and sent without a copy. gRPC C++ is the
// implementation the gRPC project measures every other language against.
//
// Built by run.sh from Debian's libgrpc++-dev (1.51 on Debian 12) with g++ -O2.
//
// Usage: grpc-cpp-peer ANSWERS_FILE HOST:PORT
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

const char* const kMethod = "/entitlements.v1.EntitlementService/CheckEntitlements";

// Customer id -> its encoded CheckEntitlementsResponse.
std::unordered_map<std::string, grpc::Slice> answers;

bool ReadLength(std::ifstream& in, uint32_t* length) {
  unsigned char bytes[4];
  if (!in.read(reinterpret_cast<char*>(bytes), 4)) return false;
  *length = (uint32_t(bytes[0]) << 24) | (uint32_t(bytes[1]) << 16) | (uint32_t(bytes[2]) << 8) | bytes[3];
  return true;
}

// Records of a 4-byte big-endian key length, the key, a 4-byte value length, the value.
bool Load(const char* path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  uint32_t length;
  while (ReadLength(in, &length)) {
    std::string key(length, '\0');
    if (!in.read(&key[0], length) || !ReadLength(in, &length)) return false;
    std::string value(length, '\0');
    if (length > 0 && !in.read(&value[0], length)) return false;
    answers.emplace(std::move(key), grpc::Slice(value));
  }
  return in.eof();
}

// Field 1 (user_id, a string) of a CheckEntitlementsRequest.
bool UserId(const std::string& request, std::string* user) {
  size_t i = 0;
  while (i < request.size()) {
    unsigned char tag = request[i++];
    uint64_t value = 0;
    int shift = 0;
    while (i < request.size()) {
      unsigned char byte = request[i++];
      value |= uint64_t(byte & 0x7F) << shift;
      shift += 7;
      if (!(byte & 0x80)) break;
    }
    if (tag == 0x0A) {
      if (i + value > request.size()) return false;
      user->assign(request, i, value);
      return true;
    }
    if ((tag & 7) == 2) {
      i += value;
    } else if ((tag & 7) != 0) {
      return false;
    }
  }
  return false;
}

class Check : public grpc::ServerGenericBidiReactor {
 public:
  Check() { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request"));
      return;
    }
    std::vector<grpc::Slice> slices;
    request_.Dump(&slices);
    std::string bytes;
    for (const auto& slice : slices) bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    std::string user;
    if (!UserId(bytes, &user)) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "user_id: missing"));
      return;
    }
    auto found = answers.find(user);
    grpc::Slice answer = found == answers.end() ? grpc::Slice() : found->second;
    response_ = grpc::ByteBuffer(&answer, 1);
    StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
  }

  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
};

class Unimplemented : public grpc::ServerGenericBidiReactor {
 public:
  Unimplemented() { Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "")); }
  void OnDone() override { delete this; }
};

class Service : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    if (context->method() == kMethod) return new Check();
    return new Unimplemented();
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: grpc-cpp-peer ANSWERS_FILE HOST:PORT\n");
    return 2;
  }
  if (!Load(argv[1])) {
    std::fprintf(stderr, "grpc-cpp peer: cannot read %s\n", argv[1]);
    return 2;
  }
  // run.sh stops servers with SIGINT, which a script's background job starts with ignored.
  std::signal(SIGINT, [](int) { _exit(0); });
  std::signal(SIGTERM, [](int) { _exit(0); });
  Service service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(argv[2], grpc::InsecureServerCredentials(), &port);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::fprintf(stderr, "grpc-cpp peer: cannot listen on %s\n", argv[2]);
    return 2;
  }
  std::printf("grpc-cpp peer listening on %s with %zu answers\n", argv[2], answers.size());
  std::fflush(stdout);
  server->Wait();
  return 0;
}
