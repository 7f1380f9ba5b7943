// SSE framing, usage and logprobs shapes, and the Prometheus exposition.
#include <gtest/gtest.h>

#include <sstream>

#include "server/metrics.h"
#include "server/response_json.h"

namespace m3::server {
namespace {

TEST(ResponseJson, SseFraming) {
  EXPECT_EQ(sse_event(Json{{"a", 1}}), "data: {\"a\":1}\n\n");
  EXPECT_EQ(sse_done(), "data: [DONE]\n\n");
  const std::string err = sse_error(Error{ErrorCode::kInternal, "bad", ""});
  ASSERT_EQ(err.rfind("data: ", 0), 0u);
  auto j = nlohmann::json::parse(err.substr(6));
  EXPECT_EQ(j["error"]["message"], "bad");
  // Broken UTF-8 from a model is replaced, never thrown.
  EXPECT_NO_THROW(sse_event(Json{{"t", std::string("\xc3")}}));
}

TEST(ResponseJson, Usage) {
  Json u = usage_json({10, 5, 4, 2});
  EXPECT_EQ(u["prompt_tokens"], 10);
  EXPECT_EQ(u["completion_tokens"], 5);
  EXPECT_EQ(u["total_tokens"], 15);
  EXPECT_EQ(u["prompt_tokens_details"]["cached_tokens"], 4);
  EXPECT_EQ(u["completion_tokens_details"]["reasoning_tokens"], 2);
}

TEST(ResponseJson, CompletionLogprobsOffsets) {
  CompletionLogprobs lp;
  lp.add("ab", std::nullopt, {});
  lp.add("c", -1.0f, {{"c", -1.0f}, {"d", -2.0f}});
  Json j = lp.to_json();
  EXPECT_TRUE(j["token_logprobs"][0].is_null());
  EXPECT_TRUE(j["top_logprobs"][0].is_null());
  EXPECT_EQ(j["text_offset"], Json::array({0, 2}));
  EXPECT_DOUBLE_EQ(j["top_logprobs"][1]["d"].get<double>(), -2.0);
}

TEST(ResponseJson, ChatDeltaCarriesBothReasoningNames) {
  ChoiceDelta d;
  d.reasoning = "hmm";
  d.text = "hi";
  text::ToolCallDelta t;
  t.index = 1;
  t.id = "call_x";
  t.name = "f";
  t.arguments_delta = "{";
  d.tool_calls.push_back(t);
  Json j = chat_delta_json(d);
  EXPECT_EQ(j["reasoning"], "hmm");
  EXPECT_EQ(j["reasoning_content"], "hmm");
  EXPECT_EQ(j["content"], "hi");
  EXPECT_EQ(j["tool_calls"][0]["index"], 1);
  EXPECT_EQ(j["tool_calls"][0]["type"], "function");
  EXPECT_EQ(j["tool_calls"][0]["function"]["name"], "f");
  EXPECT_TRUE(chat_delta_json(ChoiceDelta{}).empty());
}

TEST(Metrics, VllmNamesAndCumulativeBuckets) {
  engine::EngineStats s;
  s.num_running = 3;
  s.num_waiting = 2;
  s.kv_cache_usage = 0.25;
  s.prefix_cache_queries = 100;
  s.prefix_cache_hits = 40;
  s.requests_finished_stop = 7;
  s.time_to_first_token_s.bounds = {0.1, 1.0};
  s.time_to_first_token_s.counts = {2, 3, 1};
  s.time_to_first_token_s.count = 6;
  s.time_to_first_token_s.sum = 4.5;
  const std::string text = format_metrics(s, "m3");
  for (const char* name :
       {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_sum", "vllm:num_preemptions_total",
        "m3:num_requests_running"}) {
    EXPECT_NE(text.find(name), std::string::npos) << name;
  }
  // vLLM's labels (sorted, as prometheus_client writes them) and number format.
  EXPECT_NE(text.find("vllm:num_requests_running{engine=\"0\",model_name=\"m3\"} 3.0\n"),
            std::string::npos);
  EXPECT_NE(text.find("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m3\"} 0.25\n"),
            std::string::npos);
  EXPECT_NE(text.find("vllm:request_success_total{engine=\"0\",finished_reason=\"stop\",model_"
                      "name=\"m3\"} 7.0\n"),
            std::string::npos);
  EXPECT_NE(text.find("vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.1\",model_name="
                      "\"m3\"} 2.0\n"),
            std::string::npos);
  EXPECT_NE(text.find("vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"1.0\",model_name="
                      "\"m3\"} 5.0\n"),
            std::string::npos);
  EXPECT_NE(text.find("vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_"
                      "name=\"m3\"} 6.0\n"),
            std::string::npos);
  EXPECT_NE(text.find("vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m3\"} "
                      "6.0\n"),
            std::string::npos);
  // Every sample line is "name{labels} value" and every family has HELP and TYPE.
  std::istringstream in(text);
  std::string line;
  int samples = 0;
  while (std::getline(in, line)) {
    if (line.rfind("# ", 0) == 0) continue;
    ++samples;
    EXPECT_NE(line.find("} "), std::string::npos) << line;
  }
  EXPECT_GT(samples, 40);
}

TEST(Metrics, CacheConfigInfoAndHttpCounts) {
  engine::ModelInfo info;
  info.device = "cpu";
  engine::EngineStats s;
  s.block_size = 128;
  s.num_kv_blocks = 2048;
  s.kv_cache_dtype = "bfloat16";
  s.index_cache_dtype = "fp8_e4m3";
  ServerGauges g;
  g.http_requests.push_back({"POST", "2xx", "/v1/chat/completions", 3});
  g.http_requests.push_back({"GET", "4xx", "none", 1});
  const std::string text = format_metrics(s, "m3", g, &info);
  EXPECT_NE(text.find("vllm:cache_config_info{block_size=\"128\",cache_dtype=\"bfloat16\",device=\""
                      "cpu\",enable_prefix_caching=\"True\",engine=\"0\",indexer_kv_dtype=\"fp8_"
                      "e4m3\",model_name=\"m3\",num_gpu_blocks=\"2048\"} 1.0\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("vllm:kv_cache_capacity_tokens{engine=\"0\",index_cache_dtype=\"fp8_e4m3\","
                      "kv_cache_dtype=\"bfloat16\",model_name=\"m3\"} 262144.0\n"),
            std::string::npos);
  EXPECT_NE(text.find("http_requests_total{handler=\"/v1/chat/completions\",method=\"POST\","
                      "status=\"2xx\"} 3.0\n"),
            std::string::npos);
  EXPECT_NE(text.find("http_requests_total{handler=\"none\",method=\"GET\",status=\"4xx\"} 1.0\n"),
            std::string::npos);
  for (const char* name :
       {"vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_sum",
        "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_bucket",
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:request_time_per_output_token_seconds_bucket", "vllm:iteration_tokens_total_bucket",
        "vllm:request_params_max_tokens_bucket", "vllm:prompt_tokens_cached_total",
        "vllm:prompt_tokens_by_source_total", "vllm:request_prefill_kv_computed_tokens_bucket"}) {
    EXPECT_NE(text.find(name), std::string::npos) << name;
  }
}

TEST(Metrics, NumbersAsPrometheusClientWritesThem) {
  // Python: prometheus_client.utils.floatToGoString.
  EXPECT_EQ(prometheus_number(1), "1.0");
  EXPECT_EQ(prometheus_number(0), "0.0");
  EXPECT_EQ(prometheus_number(0.1), "0.1");
  EXPECT_EQ(prometheus_number(0.005), "0.005");
  EXPECT_EQ(prometheus_number(0.075), "0.075");
  EXPECT_EQ(prometheus_number(2560), "2560.0");
  EXPECT_EQ(prometheus_number(123456), "123456.0");
  EXPECT_EQ(prometheus_number(1000000), "1e+06");
  EXPECT_EQ(prometheus_number(1234567), "1.234567e+06");
  EXPECT_EQ(prometheus_number(1e-5), "1e-05");
  EXPECT_EQ(prometheus_number(2.5e-7), "2.5e-07");
  EXPECT_EQ(prometheus_number(-3.5), "-3.5");
  EXPECT_EQ(prometheus_number(1e20), "1e+20");
  EXPECT_EQ(prometheus_number(4.5), "4.5");
  EXPECT_EQ(prometheus_number(1.0 / 0.0), "+Inf");
}

}  // namespace
}  // namespace m3::server
